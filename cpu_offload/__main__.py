"""``python -m cpu_offload`` runs the demo."""
from .demo import main

main()
