"""`python -m fusionflow demo [options]`: the main job; see fusionflow/demo.py."""
import sys

from fusionflow.demo import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
