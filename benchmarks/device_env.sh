# Sourced first by every command run on the lent H200 (`benchmarks/README.md`): installs
# the carried wheels (.whl when carried: Ray, pydantic and fla-core, for jobs and Ray tests;
# else .whlfla: fla-core alone), puts k3batch and `kernels/` (as k3kernels) on the path,
# and restores Triton's autotuning results from the last run (carry .gpucache) so that fla's
# kernels are not tuned again; `save_autotune` writes them back under $OUT.
wheels=.whlfla
[ -d .whl ] && wheels=.whl
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    $wheels/*.whl || return 1
mkdir -p /tmp/k3p && ln -sfn "$PWD/kernels" /tmp/k3p/k3kernels
export PYTHONPATH=/tmp/k3p:/tmp/site:$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache
mkdir -p "$TRITON_CACHE_DIR"
[ -f .gpucache/autotune.tgz ] && tar xzf .gpucache/autotune.tgz -C "$TRITON_CACHE_DIR"
save_autotune() {
    (cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' | tar czf "$OUT/autotune.tgz" -T -)
}
