#!/usr/bin/env bash
# llama.cpp for trtssd, compiled once per machine.
#
#   bash scripts/setup_llamacpp.sh          the llama.cpp shared libraries, and llama-cpp-python in .venv
#                                           loading them (what trtssd's ggml executor needs)
#   bash scripts/setup_llamacpp.sh tools    also llama.cpp's own llama-server and llama-bench, built from
#                                           the same build tree (what the benchmarks' peer rows need)
#
# Both come from the llama-cpp-python sdist: its vendored llama.cpp is compiled once with CMake into
# a build folder kept in the cache; llama-cpp-python is installed with its own compile switched off
# (LLAMA_BUILD=OFF) and given those libraries, and the peer tools are later targets of the same
# build, so trtssd and the peers run the same ggml and nothing is compiled twice.
#
# The cache folder is keyed by the version and this CPU's flags (GGML_NATIVE compiles for the CPU
# it builds on). One builder at a time (flock); a finished part is marked by a stamp written only
# after its files are in place, so a killed build is resumed, never taken for a finished one.
#
# Prints the folder of the executables on its last line ("tools"), or of the libraries.
# Environment: LLAMACPP_JOBS (default: the number of cores) build jobs; TRTSSD_CACHE (default
# ~/.cache/trtssd).
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=0.3.36                        # llama-cpp-python; keep equal to trtssd/bench/llamacpp.py
CACHE=${TRTSSD_CACHE:-$HOME/.cache/trtssd}
JOBS=${LLAMACPP_JOBS:-$(nproc)}
PY=.venv/bin/python
TOOLS=(llama-server llama-bench)

say() { echo "setup_llamacpp: $*" >&2; }
die() { say "ERROR: $*"; exit 1; }

# Same rule as trtssd.bench.llamacpp.cpu_key: the sorted CPU flags, hashed.
cpu_key() {
  grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2 | tr ' ' '\n' | grep -v '^$' | LC_ALL=C sort \
    | paste -sd' ' | tr -d '\n' | sha256sum | cut -c1-12
}

HOME_DIR=$CACHE/llama.cpp/$VERSION-$(uname -m)-$(cpu_key)
SRC=$HOME_DIR/src
OUT=$HOME_DIR/build
LIB=$HOME_DIR/lib
BIN=$HOME_DIR/bin

[ -x "$PY" ] || die ".venv is missing: run scripts/setup.sh first"

# Runs a command with its output in a log, printing what is built and the time so far.
with_progress() {
  local what=$1 log=$2; shift 2
  local start pid
  start=$(date +%s)
  "$@" >"$log" 2>&1 &
  pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    sleep 15
    kill -0 "$pid" 2>/dev/null || break
    say "$what: $(( $(date +%s) - start )) s so far, $(grep -o '^\[[ 0-9]*/[0-9]*\]' "$log" | tail -1)"
  done
  wait "$pid" || { tail -30 "$log" >&2; die "$what failed (log: $log)"; }
  say "$what: done in $(( $(date +%s) - start )) s"
}

sources() {
  [ -f "$SRC/.complete" ] && return
  local dl=$CACHE/src tgz
  tgz=$dl/llama_cpp_python-$VERSION.tar.gz
  if [ ! -f "$tgz" ]; then
    mkdir -p "$dl"
    say "downloading the llama-cpp-python==$VERSION sdist"
    "$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$dl" 2>/dev/null \
      || die "pip download of llama-cpp-python==$VERSION failed"
  fi
  rm -rf "$SRC" && mkdir -p "$SRC"
  tar xzf "$tgz" -C "$SRC" --strip-components=1 || die "cannot unpack $tgz"
  [ -f "$SRC/vendor/llama.cpp/CMakeLists.txt" ] || die "$tgz has no vendor/llama.cpp"
  touch "$SRC/.complete"
}

configure() {
  [ -f "$OUT/.configured" ] && return
  command -v cmake >/dev/null || die "cmake not found (apt-get install cmake)"
  local gen=()
  command -v ninja >/dev/null && gen=(-G Ninja)
  rm -rf "$OUT" && mkdir -p "$OUT"
  # Shared libraries (llama-cpp-python loads them; the tools link them); no UI assets (they would
  # be downloaded), no CURL or OpenSSL (models are local files).
  cmake -S "$SRC/vendor/llama.cpp" -B "$OUT" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DBUILD_SHARED_LIBS=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >"$HOME_DIR/cmake.log" 2>&1 \
    || { tail -30 "$HOME_DIR/cmake.log" >&2; die "cmake configure failed (log: $HOME_DIR/cmake.log)"; }
  touch "$OUT/.configured"
}

build_libraries() {
  [ -f "$LIB/.complete" ] && return
  sources
  configure
  with_progress "compiling llama.cpp's libraries (about 2 minutes on 2 cores)" "$HOME_DIR/build-lib.log" \
    cmake --build "$OUT" --target llama -j "$JOBS"
  rm -rf "$LIB.tmp" && mkdir -p "$LIB.tmp"
  cp -P "$OUT"/bin/lib*.so* "$LIB.tmp"/
  ls "$LIB.tmp"/libllama.so >/dev/null 2>&1 || die "the build made no libllama.so (log: $HOME_DIR/build-lib.log)"
  rm -rf "$LIB" && mv "$LIB.tmp" "$LIB" && touch "$LIB/.complete"
}

build_tools() {
  [ -f "$BIN/.complete" ] && return
  build_libraries
  with_progress "compiling ${TOOLS[*]} from the same build" "$HOME_DIR/build-tools.log" \
    cmake --build "$OUT" --target "${TOOLS[@]}" -j "$JOBS"
  rm -rf "$BIN.tmp" && mkdir -p "$BIN.tmp"
  local t
  for t in "${TOOLS[@]}"; do install -m 755 "$OUT/bin/$t" "$BIN.tmp/$t"; done
  "$BIN.tmp/llama-server" --version >"$HOME_DIR/version.txt" 2>&1 || die "the built llama-server does not run"
  rm -rf "$BIN" && mv "$BIN.tmp" "$BIN" && touch "$BIN/.complete"
}

package_dir() {
  "$PY" -c "import importlib.util, sys; s = importlib.util.find_spec('llama_cpp'); print(s.submodule_search_locations[0] if s else '')"
}

# llama-cpp-python with its own CMake build switched off (pure Python), then the libraries in the
# folder it loads them from. A stamp in that folder names the build they came from.
install_package() {
  local pkg
  pkg=$(package_dir)
  if [ -n "$pkg" ] && [ "$(cat "$pkg/lib/.trtssd-build" 2>/dev/null)" = "$HOME_DIR" ]; then return; fi
  if [ -z "$pkg" ]; then
    say "installing llama-cpp-python==$VERSION (Python part only; the libraries come from the build above)"
    CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" "$PY" -m pip install -q \
      "$CACHE/src/llama_cpp_python-$VERSION.tar.gz" >"$HOME_DIR/pip.log" 2>&1 \
      || { tail -30 "$HOME_DIR/pip.log" >&2; die "installing llama-cpp-python failed (log: $HOME_DIR/pip.log)"; }
    pkg=$(package_dir)
  fi
  mkdir -p "$pkg/lib"
  cp -P "$LIB"/lib*.so* "$pkg/lib/"
  echo "$HOME_DIR" >"$pkg/lib/.trtssd-build"
  "$PY" -c "import llama_cpp" || die "llama_cpp does not import with the libraries of $LIB"
}

main() {
  local what=${1:-lib}
  case $what in lib|tools) ;; *) die "usage: setup_llamacpp.sh [lib|tools]";; esac
  mkdir -p "$HOME_DIR"
  # One builder per machine: a second setup waits here, then finds everything built.
  exec 9>"$HOME_DIR.lock"
  if ! flock -n 9; then
    say "another setup is building llama.cpp $VERSION; waiting for it"
    flock 9
  fi
  build_libraries
  install_package
  if [ "$what" = tools ]; then
    build_tools
    echo "$BIN"
  else
    echo "$LIB"
  fi
}

main "$@"
