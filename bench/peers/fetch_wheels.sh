# On a machine with PyPI (not the GPU machine, which has none), from the repository root:
#   bash bench/peers/fetch_wheels.sh        -> .peers/wheels/{roundpipe,deepspeed}/ (git-ignored)
# Every wheel of bench/peers/requirements-*.txt for Linux x86-64 and CPython 3.10-3.13 (the GPU image's
# version is not known here: pure-Python and abi3 wheels serve all; the others come once per version),
# and DeepSpeed's source distribution. Nothing is installed here.
set -e
PLATFORMS=(--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64)
for name in roundpipe deepspeed; do
  dest=.peers/wheels/$name
  mkdir -p "$dest"
  req=$(mktemp)
  grep -v -e '^#' -e '^deepspeed==' "bench/peers/requirements-$name.txt" >"$req"
  for py in 3.10 3.11 3.12 3.13; do
    python3 -m pip download -q --no-deps --only-binary :all: "${PLATFORMS[@]}" --implementation cp \
      --python-version "$py" -d "$dest" -r "$req"
  done
  rm -f "$req"
  sdist=$(grep '^deepspeed==' "bench/peers/requirements-$name.txt" || true)
  if [ -n "$sdist" ]; then
    python3 -m pip download -q --no-deps --no-binary :all: -d "$dest" "$sdist"
  fi
done
du -sh .peers/wheels/*
