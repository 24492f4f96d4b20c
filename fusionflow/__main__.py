"""`python -m fusionflow demo [options]`: the main job (fusionflow/tools/demo.py);
`python -m fusionflow profile --data DIR`: trace, timeline PNG and summary on your data
(fusionflow/tools/profile.py);
`python -m fusionflow bench --data DIR`: FusionFlowLoader vs DataLoader + torchvision on it
(fusionflow/tools/bench.py);
`python -m fusionflow gm {serve,status,workers} --job NAME`: a job's global manager
(fusionflow/runtime/gm/manager.py);
`python -m fusionflow serve --data DIR --name NAME --epochs N`: a SharedLoader for co-located jobs
(fusionflow/tools/serve.py)."""

import sys

if __name__ == "__main__":
    from fusionflow.tools.demo import main

    sys.exit(main(sys.argv[1:]))
