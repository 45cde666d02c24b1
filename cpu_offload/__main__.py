"""``python -m cpu_offload`` runs the demo."""
from .examples.demo import main

main()
