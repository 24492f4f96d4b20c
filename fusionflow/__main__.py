"""`python -m fusionflow demo [options]`: the main job (fusionflow/demo.py);
`python -m fusionflow profile --data DIR`: trace, timeline PNG and summary on your data (fusionflow/profile.py);
`python -m fusionflow bench --data DIR`: FusionFlowLoader vs DataLoader + torchvision on it (fusionflow/bench.py);
`python -m fusionflow gm {serve,status,workers} --job NAME`: a job's global manager
(fusionflow/runtime/global_manager.py)."""
import sys

if __name__ == "__main__":
    if sys.argv[1:2] == ["gm"]:
        from fusionflow.runtime.global_manager import cli
        sys.exit(cli(sys.argv[2:]))
    from fusionflow.demo import main
    sys.exit(main(sys.argv[1:]))
