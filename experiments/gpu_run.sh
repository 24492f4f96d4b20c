#!/usr/bin/env bash
# One step of a GPU session on the lent device machine (see experiments/README.md, "GPU benchmarks").
# The DALI wheels travel in parts (../shared/device/stage-dali-wheels makes .device/p0..p4); each
# step writes its log (and JSON) under $OUT, so a step stopped at its time limit still reports.
#
#   experiments/gpu_run.sh part N          copy .device/pN into /tmp/dw (runs 0-3)
#   experiments/gpu_run.sh install         after part 4: check the tar's SHA256, install to /tmp/site
#   experiments/gpu_run.sh smoke           machine, versions, native builds, CUDA tests without DALI
#   experiments/gpu_run.sh diag            the GPU JPEG decoder's gap from libjpeg-turbo on the tests' JPEGs
#   experiments/gpu_run.sh tests           pytest -m gpu (every GPU test)
#   experiments/gpu_run.sh bench ARGS      python3 -m experiments.gpu_bench ARGS
#   experiments/gpu_run.sh memory ARGS     python3 -m experiments.gpu_memory ARGS
#   experiments/gpu_run.sh dalimem ARGS    python3 -m experiments.dali_memory --device cuda ARGS (the bridge
#                                          arena's calibration: DALI's device memory per sample of a run)
#   experiments/gpu_run.sh firstrun ARGS   python3 -m experiments.dali_first_run --device cuda ARGS (the hardware
#                                          JPEG decoder's share, fixed at a pipeline's first run: sized or not)
#   experiments/gpu_run.sh aot ARGS        python3 -m experiments.bench_aot --device gpu ARGS
#   experiments/gpu_run.sh graph ARGS      python3 -m experiments.bench_graph --device cuda ARGS (our DALI graph
#                                          alone against DALI's own RandAugment graph, per run size)
#   experiments/gpu_run.sh timm ARGS       fusionflow.timm's CUDA leg: bench_timm --mode loader --device cuda ARGS;
#                                          timm travels as one wheel (`pip download --no-deps timm==1.0.31 -d .whl`,
#                                          carry .whl; timm.data needs neither huggingface_hub nor safetensors)
# Every step runs from the repository root (the script cds there), so `-m experiments.<name>` imports this
# checkout's experiments and fusionflow; /tmp/site (the installed DALI wheels) comes first on PYTHONPATH.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
step=$1
shift
case $step in
part)
    mkdir -p /tmp/dw && cp ".device/p$1"/* /tmp/dw/ && ls -la /tmp/dw
    ;;
install)
    cd /tmp/dw && cat part-* >all.tar && echo "$(cat SHA256)  all.tar" | sha256sum -c &&
        mkdir -p whl && tar xf all.tar -C whl &&
        python3 -m pip install -q --no-index --no-deps --target /tmp/site whl/*.whl &&
        rm -f all.tar part-* && python3 -c "import nvidia.dali as d, posix_ipc; print('DALI', d.__version__)"
    ;;
smoke)
    {
        nvidia-smi
        nproc
        python3 -c "import sys, torch, torchvision, PIL, cv2, numpy; print(sys.version); print(torch.__version__, torch.version.cuda, torchvision.__version__, PIL.__version__, cv2.__version__, numpy.__version__); print(torch.cuda.get_device_name(0))"
        which g++ c++ nvcc
        ls /usr/include/jpeglib.h
        python3 -c "import fusionflow; print('fusionflow', fusionflow.__version__)"
    } 2>&1 | tee "$OUT/smoke.log"
    ;;
diag)
    python3 -c "from experiments.dali_agreement import nvjpeg_gap
from fusionflow.tools.synthetic import make_jpegs
print('nvJPEG vs libjpeg-turbo (mean levels, median PSNR dB):', nvjpeg_gap(make_jpegs(16, 200, 1000, seed=1)))" 2>&1 |
        grep -v -i deprecat | tee "$OUT/diag.log"
    ;;
tests)
    files=("$@")
    [ ${#files[@]} -gt 0 ] || files=(tests/test_device_ring.py tests/test_ops_dali.py tests/test_accelerator.py tests/test_bridge.py
        tests/test_loader.py tests/test_loader_parts.py tests/test_trace.py tests/test_erase.py)
    python3 -m pytest -m gpu -p no:cacheprovider -q -rs --timeout 240 --junitxml="$OUT/gpu_tests.xml" \
        "${files[@]}" 2>&1 | tee "$OUT/gpu_tests.log"
    ;;
bench)
    python3 -m experiments.gpu_bench --out "$OUT/gpu_bench.json" "$@" 2>&1 | tee "$OUT/gpu_bench.log"
    ;;
timm)
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/timm-*.whl &&
        python3 -m experiments.bench_timm --mode loader --device cuda --out "$OUT/timm_loader_gpu.json" "$@" 2>&1 |
        tee "$OUT/timm_loader_gpu.log"
    ;;
memory)
    python3 -m experiments.gpu_memory --out "$OUT/gpu_memory.json" "$@" 2>&1 | tee "$OUT/gpu_memory.log"
    ;;
dalimem)
    python3 -m experiments.dali_memory --device cuda --out "$OUT/dali_memory_cuda.json" "$@" 2>&1 |
        grep -v -i deprecat | tee "$OUT/dali_memory_cuda.log"
    ;;
graph)
    python3 -m experiments.bench_graph --device cuda --out "$OUT/bench_graph_gpu.json" "$@" 2>&1 |
        tee "$OUT/bench_graph_gpu.log"
    ;;
firstrun)
    python3 -m experiments.dali_first_run --device cuda --out "$OUT/dali_first_run.json" "$@" 2>&1 |
        grep -v -i deprecat | tee "$OUT/dali_first_run.log"
    ;;
aot)
    python3 -m experiments.bench_aot --device gpu --out "$OUT/aot_gpu.json" "$@" 2>&1 | tee "$OUT/aot_gpu.log"
    ;;
*)
    echo "unknown step $step" >&2
    exit 2
    ;;
esac
