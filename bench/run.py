"""Thin wrapper: ``python bench/run.py [options]`` == ``python -m flash_cute.bench [options]``."""
import os
import sys

# Run from a checkout without installing: put the project root (this file's parent's parent)
# first on the path so ``flash_cute`` resolves to this tree.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from flash_cute.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
