"""Every code block in README.md and docs/*.md works as written.

- ```python blocks run: each file's blocks in order, in one fresh namespace per file (a page's
  later blocks continue its earlier ones), in a subprocess with CUDA hidden. A block that needs
  CUDA checks ``torch.cuda.is_available()`` and falls back to ``SimulatedDevice``.
- ```bash / ```sh blocks are checked, not run: each ``python3 -m MODULE`` and ``python3 SCRIPT``
  (also after ``torchrun``) names a module or script that exists and answers ``--help`` with exit
  status 0; each ``pip install -e .[EXTRA]`` names an extra of setup.cfg; each ``tox -e ENV``
  names an env of tox.ini; each path into the repository exists.
- ```text blocks are output samples; any other fence language is an error, so that no code
  block escapes these checks.
- On a GPU machine, the ``gpu``-marked test runs the python blocks again with CUDA visible.

One subprocess does all the running (python blocks and ``--help`` calls), so torch is imported
once. Run it alone with ``python3 -m pytest tests/test_doc_blocks.py``.
"""
from __future__ import annotations

import configparser
import contextlib
import importlib.util
import io
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.M | re.S)
LANGUAGES = {"python", "bash", "sh", "text"}
# Paths into the repository that a shell block may name; each must exist.
REPO_PATH = re.compile(r"^(?:\./)?(?:tests|benchmarks|docs|cpu_offload|\.ci)/[\w./-]*$")


def find_root() -> Path:
    for parent in Path(__file__).resolve().parents:
        if (parent / "setup.cfg").exists() and (parent / "README.md").exists():
            return parent
    return Path(__file__).resolve().parents[1]


ROOT = find_root()


def doc_files() -> list[Path]:
    return [p for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))] if p.exists()]


def blocks(path: Path) -> list[tuple[str, int, str]]:
    """``(language, first code line, code)`` of every fenced block of a markdown file."""
    text = path.read_text(encoding="utf-8")
    return [
        (m.group(1).strip(), text.count("\n", 0, m.start(2)) + 1, m.group(2))
        for m in FENCE.finditer(text)
    ]


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


# --- shell blocks: what a command names ------------------------------------------------------


def commands(code: str) -> list[list[str]]:
    """The simple commands of a shell block: lines, split at ``&&``, ``;`` and ``|``."""
    out = []
    for line in code.splitlines():
        try:
            words = shlex.split(line, comments=True)
        except ValueError as e:
            raise AssertionError(f"cannot parse shell line {line!r}: {e}") from e
        cmd: list[str] = []
        for w in words + ["&&"]:
            if w in ("&&", "||", ";", "|"):
                if cmd:
                    out.append(cmd)
                cmd = []
            else:
                cmd.append(w)
    return out


def strip_python(cmd: list[str]) -> list[str]:
    """The arguments after ``python3``/``python`` (and its own ``-I``/``-u``-style flags)."""
    i = 1
    while i < len(cmd) and cmd[i] in ("-I", "-u", "-B", "-E", "-s", "-O"):
        i += 1
    return cmd[i:]


def setup_extras() -> set:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    section = "options.extras_require"
    return set(cfg[section]) if cfg.has_section(section) else set()


def tox_envs() -> set:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "tox.ini")
    return {e.strip() for e in cfg.get("tox", "env_list", fallback="").replace("\n", ",").split(",")
            if e.strip()}


def pip_installs(cmds: list[list[str]]) -> list[str]:
    """Everything ``pip install`` is asked for in these commands (``-e`` targets included)."""
    wanted = []
    for cmd in cmds:
        if cmd[0] == "pip":
            args = cmd[1:]
        elif cmd[0].startswith("python") and strip_python(cmd)[:2] == ["-m", "pip"]:
            args = strip_python(cmd)[2:]
        else:
            continue
        if args[:1] == ["install"]:
            wanted += [a for a in args[1:] if not a.startswith("-")]
    return wanted


def module_exists(module: str) -> bool:
    """Importable here, or a module of the repository (``tests.fuzz``: the blocks run from its
    root, which the installed package's test run does not have on its path)."""
    try:
        if importlib.util.find_spec(module) is not None:
            return True
    except ModuleNotFoundError:
        pass
    path = ROOT.joinpath(*module.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def check_shell_block(code: str) -> tuple[list[str], list[tuple[str, str]]]:
    """Problems found without running anything, and the ``--help`` calls to make:
    ``("module", name)`` or ``("script", path)``."""
    cmds = commands(code)
    installed = pip_installs(cmds)
    problems: list[str] = []
    helps: list[tuple[str, str]] = []
    extras = setup_extras()
    for cmd in cmds:
        for word in cmd:
            if REPO_PATH.match(word) and not (ROOT / word).exists():
                problems.append(f"{' '.join(cmd)}: {word} does not exist")
        if cmd[0].startswith("python"):
            args = strip_python(cmd)
            if args[:1] == ["-m"] and len(args) > 1:
                module = args[1]
                if module == "pip":
                    pass  # checked below as an install
                elif not module_exists(module):
                    if module not in installed:
                        problems.append(f"{' '.join(cmd)}: no module {module}, and the block "
                                        f"does not install it")
                else:
                    helps.append(("module", module))
                if module == "tox" and "-e" in args:
                    env = args[args.index("-e") + 1]
                    if env not in tox_envs():
                        problems.append(f"{' '.join(cmd)}: tox.ini has no env {env}")
            elif args and args[0].endswith(".py"):
                helps.append(("script", args[0]))
        elif cmd[0] == "torchrun":
            scripts = [w for w in cmd[1:] if w.endswith(".py")]
            if not scripts:
                problems.append(f"{' '.join(cmd)}: names no script")
            helps += [("script", s) for s in scripts[:1]]
        elif cmd[0] == ".ci/run" and not os.access(ROOT / ".ci/run", os.X_OK):
            problems.append(".ci/run is not executable")
        for target in pip_installs([cmd]):
            m = re.fullmatch(r"\.\[([\w,-]+)\]", target)
            if target.startswith(".") and target != "." and not m:
                problems.append(f"{' '.join(cmd)}: cannot read the extra in {target!r}")
            for extra in (m.group(1).split(",") if m else []):
                if extra not in extras:
                    problems.append(f"{' '.join(cmd)}: setup.cfg has no extra {extra!r} "
                                    f"(it has {sorted(extras)})")
    return problems, helps


# --- the runner: one subprocess runs every python block and every --help ---------------------


def _run_help(kind: str, target: str) -> dict:
    import runpy

    argv, path = sys.argv[:], sys.path[:]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            if kind == "module":
                sys.argv = [target, "--help"]
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:
                script = str(ROOT / target)
                sys.argv = [script, "--help"]
                sys.path.insert(0, str(Path(script).parent))
                runpy.run_path(script, run_name="__main__")
        return {"ok": True}  # returned without exiting: no argparse, nothing ran past it
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        return {"ok": code == 0, "error": f"exit status {e.code!r}\n{out.getvalue()[-2000:]}"}
    except BaseException:  # noqa: BLE001 - report anything
        return {"ok": False, "error": traceback.format_exc()[-3000:] + out.getvalue()[-1000:]}
    finally:
        sys.argv, sys.path[:] = argv, path


def _run_file(path: Path) -> list[dict]:
    namespace: dict = {"__name__": "__main__"}
    env = dict(os.environ)
    results: list[dict] = []
    failed_at = None
    for lang, line, code in blocks(path):
        if lang != "python":
            continue
        if failed_at is not None:
            results.append({"line": line, "status": "not run",
                            "error": f"the block at line {failed_at} failed"})
            continue
        out = io.StringIO()
        start = time.perf_counter()
        try:
            compiled = compile("\n" * (line - 1) + code, str(path), "exec")
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                exec(compiled, namespace)
            results.append({"line": line, "status": "ok", "seconds": time.perf_counter() - start})
        except BaseException:  # noqa: BLE001 - report anything, SystemExit included
            failed_at = line
            results.append({"line": line, "status": "failed",
                            "error": traceback.format_exc()[-4000:],
                            "output": out.getvalue()[-2000:]})
    os.environ.clear()
    os.environ.update(env)
    return results


def runner_main(job_path: str, result_path: str) -> None:
    import warnings

    warnings.simplefilter("ignore")
    from _support import strict_warnings  # this file's folder is the runner's sys.path[0]

    if strict_warnings.enabled():
        strict_warnings.install()
    job = json.loads(Path(job_path).read_text())
    result: dict = {"help": {}, "python": {}, "seconds": {}}
    for kind, target in job["helps"]:
        start = time.perf_counter()
        result["help"][f"{kind}:{target}"] = _run_help(kind, target)
        result["seconds"][f"{kind}:{target}"] = time.perf_counter() - start
    for name in job["files"]:
        start = time.perf_counter()
        result["python"][name] = _run_file(ROOT / name)
        result["seconds"][name] = time.perf_counter() - start
    Path(result_path).write_text(json.dumps(result))


if __name__ == "__main__":
    runner_main(sys.argv[1], sys.argv[2])
    sys.stdout.flush()
    os._exit(0)  # worker threads a block left running (an optimizer not closed) do not matter


# --- the tests --------------------------------------------------------------------------------

import pytest  # noqa: E402  (the runner above needs no pytest)

FILES = doc_files()
PY_BLOCKS = [(rel(p), line) for p in FILES for lang, line, _ in blocks(p) if lang == "python"]
SH_BLOCKS = [(rel(p), line, code) for p in FILES for lang, line, code in blocks(p)
             if lang in ("bash", "sh")]


def run_blocks(helps: list, hide_cuda: bool) -> dict:
    """Runs the subprocess: every python block, and the ``--help`` calls in ``helps``."""
    files = sorted({name for name, _ in PY_BLOCKS})
    with tempfile.TemporaryDirectory() as tmp:
        job, result = Path(tmp, "job.json"), Path(tmp, "result.json")
        job.write_text(json.dumps({"helps": helps, "files": files}))
        env = dict(os.environ, OMP_NUM_THREADS="1", MPLBACKEND="Agg",
                   TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        # The blocks import the cpu_offload this test imported (installed, or the source tree
        # when run with PYTHONPATH), also from the temporary working directory.
        import cpu_offload  # here, not at the top: the runner half of this file runs without it

        # The repository root after it: blocks may import the tests' own tools (tests.fuzz).
        root = os.path.dirname(os.path.dirname(os.path.abspath(cpu_offload.__file__)))
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (root, str(ROOT), env.get("PYTHONPATH")) if p)
        if hide_cuda:
            env["CUDA_VISIBLE_DEVICES"] = ""
        proc = subprocess.run(
            [sys.executable, __file__, str(job), str(result)], cwd=tmp, env=env,
            capture_output=True, text=True, timeout=600,
        )
        if proc.returncode != 0 or not result.exists():
            pytest.fail(f"the doc-block runner failed (exit {proc.returncode}):\n"
                        f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        return json.loads(result.read_text())


@pytest.fixture(scope="module")
def ran() -> dict:
    """Every python block on the CPU (CUDA hidden), and every ``--help`` the shell blocks name."""
    helps = sorted({h for _, _, code in SH_BLOCKS for h in check_shell_block(code)[1]})
    return run_blocks(helps, hide_cuda=True)


def test_there_are_doc_blocks_to_check():
    assert any(p.name == "README.md" for p in FILES)
    assert PY_BLOCKS and SH_BLOCKS


@pytest.mark.parametrize("path", FILES, ids=[rel(p) for p in FILES])
def test_every_fence_has_a_checked_language(path):
    bad = [f"{rel(path)}:{line}: ```{lang}" for lang, line, _ in blocks(path)
           if lang not in LANGUAGES]
    assert not bad, ("fence a block as python or bash (it is then run or checked), or as text "
                     "(an output sample):\n" + "\n".join(bad))


def _has_offload_policies() -> bool:
    from cpu_offload.compat import cpu_offload_policies

    return bool(cpu_offload_policies())


# Pages about a feature some supported torch releases lack: (available, skip reason).
NEEDS = {
    "docs/checkpoint_policies.md": (
        _has_offload_policies,
        "needs torch's CheckpointPolicy.MUST_CPU_OFFLOAD (absent in this torch release)",
    ),
}


@pytest.mark.parametrize("name, line", PY_BLOCKS, ids=[f"{n}:{line}" for n, line in PY_BLOCKS])
def test_python_block_runs(ran, name, line):
    need = NEEDS.get(name)
    if need is not None and not need[0]():
        pytest.skip(need[1])
    result = next(r for r in ran["python"][name] if r["line"] == line)
    assert result["status"] == "ok", (
        f"{name}:{line}: {result['status']}\n{result.get('error', '')}\n"
        f"output:\n{result.get('output', '')}"
    )


@pytest.mark.parametrize("name, line, code", SH_BLOCKS,
                         ids=[f"{n}:{line}" for n, line, _ in SH_BLOCKS])
def test_shell_block_names_what_exists(ran, name, line, code):
    problems, helps = check_shell_block(code)
    for kind, target in helps:
        answer = ran["help"][f"{kind}:{target}"]
        if not answer["ok"]:
            problems.append(f"{target} --help failed: {answer.get('error', '')}")
    assert not problems, f"{name}:{line}:\n" + "\n".join(problems)


def test_command_parsing():
    """The checks above read what they should (a wrong parser passes every block)."""
    problems, helps = check_shell_block(
        "pip install -e '.[test]' && python3 -m pytest tests  # comment\n"
        "python3 benchmarks/frontier.py --out x\n"
        "torchrun --nproc-per-node 2 tests/_support/distributed_cases.py --case ddp\n"
    )
    assert problems == []
    assert helps == [("module", "pytest"), ("script", "benchmarks/frontier.py"),
                     ("script", "tests/_support/distributed_cases.py")]
    problems, _ = check_shell_block(
        "pip install -e .[nosuchextra]\npython3 -m pip install -e '.[test,other]'\n"
        "python3 -m no_such_module_here\n"
        "python3 benchmarks/no_such.py\npython3 -m tox -e torch999\n"
    )
    assert any("no extra 'nosuchextra'" in p for p in problems)
    assert any("no extra 'other'" in p for p in problems)
    assert not any("no extra 'test'" in p for p in problems)
    assert any("no module no_such_module_here" in p for p in problems)
    assert any("benchmarks/no_such.py does not exist" in p for p in problems)
    assert any("no module tox" in p or "no env torch999" in p for p in problems)


@pytest.mark.gpu
def test_python_blocks_run_unchanged_on_a_gpu():
    """The same blocks with CUDA visible: they take their GPU branch (``device=None``)."""
    ran_on_gpu = run_blocks([], hide_cuda=False)
    failed = [f"{name}:{r['line']}: {r['status']}\n{r.get('error', '')}"
              for name, results in ran_on_gpu["python"].items() for r in results
              if r["status"] != "ok"]
    assert not failed, "\n".join(failed)
