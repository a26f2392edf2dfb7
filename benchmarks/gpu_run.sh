#!/usr/bin/env bash
# The one command for a GPU machine without network (benchmarks/README.md):
#
#   bash benchmarks/gpu_run.sh [--device cpu] [--budget SECONDS] [gpu_check.py options, e.g. --only fsdp,nccl1]
#   bash benchmarks/gpu_run.sh --wheels     # beforehand, where pip reaches the registry: fills .whl/
#
# 1. Installs the pure-Python wheels that travel in .whl/ (hydra-core, omegaconf, antlr4-python3-runtime for the
#    Hydra app and the tests' helpers; pytest, pluggy, iniconfig, pygments for stage 0) into /tmp/site, without
#    the network, and the checkout itself with --no-deps into /tmp/site/checkout (a check that it installs
#    offline; the checkout is what runs); the machine's torch, Lightning and torchmetrics stay.
# 2. Stage 0 (about 20 s on a GPU host): versions; tests/test_compat.py against this machine's torch and Lightning
#    (at most 60 s; 180 s on CPU, a shared machine's); a one-rank NCCL group (cuda) and a gloo group, each an
#    all-reduce.
# 3. benchmarks/gpu_check.py within what is left of --budget (default 570 s on cuda: one 600 s command).
# Everything goes under $OUT (default /tmp/gpu_run), four files (the device returns at most 8): gpu_run.log (all of
# it), versions.txt, gpu_check.md (the table) and logs.tar.gz (stage0_*.log and logs/NAME.log, each check's whole
# output, packed at the end, also when the run is interrupted). Exit status 1 when anything failed.
set -uo pipefail
cd "$(dirname "$0")/.."
TRAVEL=(hydra-core omegaconf antlr4-python3-runtime pytest pluggy iniconfig pygments)

if [[ "${1:-}" == "--wheels" ]]; then  # the versions this machine's suite runs with, as wheels (antlr4: built)
    mkdir -p .whl
    pins=$(python3 -c 'import importlib.metadata as m, sys; print(" ".join(f"{n}=={m.version(n)}" for n in sys.argv[1:]))' "${TRAVEL[@]}") || exit 1
    # shellcheck disable=SC2086
    python3 -m pip wheel -q --no-deps -w .whl $pins && ls -l .whl
    exit $?
fi

device=cuda
budget=""
passthrough=()
while (($#)); do
    case "$1" in
        --device) device=$2; shift 2 ;;
        --budget) budget=$2; shift 2 ;;
        *) passthrough+=("$1"); shift ;;
    esac
done
budget=${budget:-$([[ $device == cuda ]] && echo 570 || echo 1700)}
OUT=${OUT:-/tmp/gpu_run}
mkdir -p "$OUT/logs"
exec > >(tee "$OUT/gpu_run.log") 2>&1
pack() {  # the logs as one file: what comes back from the device is at most 8 files
    tar czf "$OUT/logs.tar.gz" -C "$OUT" logs $(cd "$OUT" && ls stage0_*.log 2> /dev/null) \
        && rm -rf "$OUT/logs" "$OUT"/stage0_*.log
}
trap pack EXIT
trap 'exit 143' TERM HUP INT
start=$SECONDS
failed=0
step() { echo "== $1 ($((SECONDS - start)) s)"; }

step "install: the wheels that travel, then the checkout (--no-deps, offline)"
site=${SITE:-/tmp/site}  # where the wheels and the installed checkout go (SITE: another folder)
shopt -s nullglob
wheels=(.whl/*.whl)
if ((${#wheels[@]})) && python3 -m pip --version > /dev/null 2>&1; then
    python3 -m pip install -q --upgrade --root-user-action=ignore --no-index --no-deps --no-compile --target "$site" "${wheels[@]}" || failed=1
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
elif ((${#wheels[@]})); then  # no pip: a pure-Python wheel is a zip of its files
    echo "no pip here: the wheels unpacked into $site"
    for wheel in "${wheels[@]}"; do python3 -m zipfile -e "$wheel" "$site" || failed=1; done
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
elif ! python3 -c 'import hydra, omegaconf, pytest' 2>/dev/null; then
    echo "no .whl/ and no hydra/omegaconf/pytest here: run 'bash benchmarks/gpu_run.sh --wheels' where pip reaches the registry"
    exit 1
else
    echo "no .whl/: this machine's hydra, omegaconf and pytest"
fi
[[ -e lightning_solo/conf ]] || ln -s ../conf lightning_solo/conf  # the config tree, as in a checkout for work
python3 -m pip install -q --upgrade --root-user-action=ignore --no-index --no-deps --no-build-isolation --no-compile --target "$site/checkout" . \
    > "$OUT/stage0_install.log" 2>&1 && echo "the checkout installs: $(ls "$site/checkout" | tr '\n' ' ')" \
    || { echo "the checkout did not install: $OUT/stage0_install.log"; failed=1; }
export GLOO_SOCKET_IFNAME=lo OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}

step "stage 0: versions"
timeout 20 python3 - <<'EOF' | tee "$OUT/versions.txt" || failed=1
import importlib.metadata as m, platform, torch
print("python", platform.python_version(), "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| cudnn", torch.backends.cudnn.version(), "| nccl", torch.cuda.nccl.version() if torch.cuda.is_available() else None)
print("gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
for name in ("lightning", "torchvision", "torchmetrics", "hydra-core", "omegaconf", "pytest", "numpy"):
    try:
        print(name, m.version(name))
    except m.PackageNotFoundError:
        print(name, "absent")
EOF

step "stage 0: tests/test_compat.py on this torch and Lightning"
compat_limit=$([[ $device == cuda ]] && echo 60 || echo 180)
timeout "$compat_limit" python3 -m pytest -o addopts="" -p no:cacheprovider -q tests/test_compat.py \
    > "$OUT/stage0_compat.log" 2>&1 || { failed=1; echo "test_compat: failed or past its $compat_limit s"; }
tail -n 3 "$OUT/stage0_compat.log"

step "stage 0: a one-rank NCCL group and a gloo group"
timeout 30 python3 - "$device" <<'EOF' 2>&1 | tee "$OUT/stage0_groups.log"
import sys, tempfile, torch, torch.distributed as dist
device = sys.argv[1]
store = dist.FileStore(tempfile.mktemp(), 1)
backend = "nccl" if device == "cuda" else "gloo"
dist.init_process_group(backend, store=store, rank=0, world_size=1)
if device == "cuda":
    x = torch.ones(4, device="cuda")
    dist.all_reduce(x)
    torch.cuda.synchronize()
    print("nccl: one rank, all_reduce", x.tolist())
else:
    print("nccl: not on --device cpu")
gloo = dist.new_group(backend="gloo")
y = torch.ones(4)
dist.all_reduce(y, group=gloo)
print("gloo: one rank, all_reduce", y.tolist())
dist.destroy_process_group()
print("groups: OK")
EOF
grep -q "groups: OK" "$OUT/stage0_groups.log" || failed=1

left=$((budget - (SECONDS - start) - 5))
step "gpu_check.py --device $device --budget $left"
python3 benchmarks/gpu_check.py --device "$device" --budget "$left" --out "$OUT/gpu_check.md" --logs "$OUT/logs" \
    "${passthrough[@]}" || failed=1
step "done: $([[ $failed == 0 ]] && echo all passed || echo something failed) (the table: $OUT/gpu_check.md)"
exit $failed
