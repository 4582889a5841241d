import sys
from pathlib import Path

# tests/ helpers (tiny_models) importable from every test module
sys.path.insert(0, str(Path(__file__).parent))
