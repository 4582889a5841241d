#!/usr/bin/env bash
# llama.cpp next to trtssd: builds llama.cpp's own executables (llama-server, llama-bench,
# llama-speculative) and makes sure llama-cpp-python is installed in .venv.
#
# Both come from one PyPI package, the llama-cpp-python sdist: its vendored llama.cpp tree is the
# source of the executables, so `trtssd bench`'s llama.cpp rows and trtssd's ggml backend run the
# same ggml. PyPI has no binary wheel of either, hence the builds; both are cached per machine
# (~/.cache/trtssd) and keyed by version, so a second run only checks that the files are there.
#
# Usage: bash scripts/setup_llamacpp.sh        (prints the bin folder on its last line)
# Environment: LLAMACPP_JOBS (default 2) build jobs; TRTSSD_CACHE (default ~/.cache/trtssd).
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=0.3.36                        # llama-cpp-python; its vendor/llama.cpp is what we build
CACHE=${TRTSSD_CACHE:-$HOME/.cache/trtssd}
PREFIX=$CACHE/llama.cpp/$VERSION
BIN=$PREFIX/bin
WHEELS=$CACHE/wheels
JOBS=${LLAMACPP_JOBS:-2}
PY=.venv/bin/python
TOOLS=(llama-server llama-bench llama-speculative)

say() { echo "setup_llamacpp: $*" >&2; }
die() { say "ERROR: $*"; exit 1; }

[ -x "$PY" ] || die ".venv is missing: run scripts/setup.sh first"

have_tools() {
  local t
  for t in "${TOOLS[@]}"; do [ -x "$BIN/$t" ] || return 1; done
}

# find_spec instead of an import: importing llama_cpp loads the whole shared library.
have_llama_cpp() {
  "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llama_cpp') is None)"
}

# The sdist, downloaded once; pip downloads sources only with --no-binary.
sdist() {
  local src=$CACHE/src
  local tgz=$src/llama_cpp_python-$VERSION.tar.gz
  if [ ! -f "$tgz" ]; then
    mkdir -p "$src"
    say "downloading the llama-cpp-python==$VERSION sdist"
    "$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$src" \
      || die "pip download of llama-cpp-python==$VERSION failed"
  fi
  echo "$tgz"
}

build_tools() {
  local tgz work tree t start
  tgz=$(sdist)
  work=$PREFIX/build
  rm -rf "$work" && mkdir -p "$work"
  tar xzf "$tgz" -C "$work" || die "cannot unpack $tgz"
  tree=$work/llama_cpp_python-$VERSION/vendor/llama.cpp
  [ -f "$tree/tools/server/CMakeLists.txt" ] || die "$tgz has no vendor/llama.cpp/tools/server"
  command -v cmake >/dev/null || die "cmake not found (apt-get install cmake)"
  local gen=()
  command -v ninja >/dev/null && gen=(-G Ninja)
  say "building ${TOOLS[*]} from $tree with $JOBS jobs (about 10 minutes on 2 cores)"
  start=$(date +%s)
  # Static libraries: the executables then need nothing from the build folder, which is removed.
  # No UI assets (they would be downloaded), no CURL or OpenSSL (models are local files).
  cmake -S "$tree" -B "$work/out" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_BUILD_TESTS=OFF >"$work/cmake.log" 2>&1 \
    || { tail -30 "$work/cmake.log" >&2; die "cmake configure failed (log: $work/cmake.log)"; }
  cmake --build "$work/out" --target "${TOOLS[@]}" -j "$JOBS" >"$work/build.log" 2>&1 \
    || { tail -30 "$work/build.log" >&2; die "cmake build failed (log: $work/build.log)"; }
  mkdir -p "$BIN"
  for t in "${TOOLS[@]}"; do install -m 755 "$work/out/bin/$t" "$BIN/$t"; done
  "$BIN/llama-server" --version >"$PREFIX/version.txt" 2>&1 || die "the built llama-server does not run"
  say "built in $(( $(date +%s) - start )) s"
  rm -rf "$work"
}

# Another process (a second setup, or a build started by hand) may be building the wheel already:
# wait for it rather than compiling llama.cpp twice on the same cores.
wait_for_other_wheel_build() {
  while pgrep -f "pip wheel.*llama-cpp-python" >/dev/null; do
    say "waiting for a llama-cpp-python wheel build already running"
    sleep 10
  done
}

install_wheel() {
  local wheel
  wait_for_other_wheel_build
  wheel=$(ls "$WHEELS"/llama_cpp_python-"$VERSION"-*.whl 2>/dev/null | head -1 || true)
  if [ -z "$wheel" ]; then
    mkdir -p "$WHEELS"
    say "building the llama-cpp-python==$VERSION wheel (about 5 minutes on 2 cores)"
    CMAKE_BUILD_PARALLEL_LEVEL=$JOBS "$PY" -m pip wheel -q --no-deps "llama-cpp-python==$VERSION" -w "$WHEELS" \
      || die "building the llama-cpp-python wheel failed"
    wheel=$(ls "$WHEELS"/llama_cpp_python-"$VERSION"-*.whl | head -1)
  fi
  say "installing $wheel"
  "$PY" -m pip install -q "$wheel" || die "installing $wheel failed"
}

main() {
  mkdir -p "$CACHE/llama.cpp"
  # One builder per machine: a second setup waits here and then finds everything built.
  exec 9>"$CACHE/llama.cpp/$VERSION.lock"
  flock 9
  have_tools || build_tools
  have_llama_cpp || install_wheel
  have_llama_cpp || die "llama_cpp still not importable from .venv"
  say "llama.cpp $VERSION executables: $BIN"
  say "llama-cpp-python $VERSION: $("$PY" -c 'import importlib.util; print(importlib.util.find_spec("llama_cpp").submodule_search_locations[0])')"
  echo "$BIN"
}

main "$@"
