#!/usr/bin/env bash
# Builds every cargo-fuzz target and runs each for SECONDS from a fresh seed corpus; exits non-zero if any
# target crashes (panic, failed assertion, sanitizer report, timeout, out of memory).
#
#   bash fuzz/run.sh 60        # what CI runs
#
# Works on a stable toolchain: cargo-fuzz needs nightly flags (-Zsanitizer=address), which RUSTC_BOOTSTRAP=1
# unlocks on stable. Installs cargo-fuzz with `cargo install --locked` if it is missing.
# Environment: APEX_FUZZ_SANITIZER (address | none; default address), CARGO_TARGET_DIR (default fuzz/target).
# Crash inputs are copied to fuzz/artifacts/ (ignored by git) and printed as base64.
set -euo pipefail

seconds=${1:?usage: bash fuzz/run.sh SECONDS}
case $seconds in '' | *[!0-9]*) echo "SECONDS must be a whole number, got '$seconds'" >&2; exit 2 ;; esac

fuzz_dir=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$fuzz_dir")
cd "$fuzz_dir"

targets=(cubin_parse fatbin module_image printf_record pushbuf_decode gpfifo_entry)
sanitizer=${APEX_FUZZ_SANITIZER:-address}
target_dir=${CARGO_TARGET_DIR:-$fuzz_dir/target}
triple=$(rustc -vV | sed -n 's/^host: //p')
export RUSTC_BOOTSTRAP=1
# As `cargo fuzz run` sets it.
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_odr_violation=0}

# libfuzzer-sys compiles libFuzzer (C++) with the cc crate.
if ! command -v c++ >/dev/null 2>&1 && ! command -v clang++ >/dev/null 2>&1; then
  echo "== installing a C++ compiler (for libFuzzer)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq g++ >/dev/null
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "== installing cargo-fuzz"
  cargo install cargo-fuzz --locked
fi
cargo fuzz --version

echo "== build (sanitizer: $sanitizer)"
start=$SECONDS
CARGO_TARGET_DIR=$target_dir cargo fuzz build --sanitizer "$sanitizer" --target "$triple"
echo "built in $((SECONDS - start)) s"
bin_dir=$target_dir/$triple/release

work=$(mktemp -d "${TMPDIR:-/tmp}/apex-fuzz.XXXXXX")
trap 'rm -rf "$work"' EXIT

failed=()
for t in "${targets[@]}"; do
  corpus=$work/corpus/$t
  mkdir -p "$corpus" "$work/artifacts"
  extra=()
  env_args=()
  case $t in
    cubin_parse | fatbin) cp "$root"/kernels/*.cubin "$root"/kernels/*.fatbin "$corpus"/ ;;
    # nvcc's fatbins in every compression mode, PTX, and the fatbin sections of host programs (the programs
    # themselves are 1 MB of host code the parser skips).
    module_image)
      cp "$root"/tests/fixtures/modules/*.fatbin "$root"/tests/fixtures/modules/module_data.ptx \
        "$fuzz_dir"/seeds/module_image/* "$corpus"/
      extra=(-max_len=65536) ;;
    # The target writes pushbuffers and QMDs from apex's own encoders into the corpus before fuzzing.
    pushbuf_decode) env_args=(APEX_FUZZ_SEED_DIR="$corpus") extra=(-max_len=8192) ;;
    # Records as APEX's device runtime writes them, and the runtime object itself.
    printf_record) cp "$fuzz_dir"/seeds/printf_record/* "$corpus"/ && extra=(-max_len=16384) ;;
    gpfifo_entry) ;;
  esac
  log=$work/$t.log
  rc=0
  env "${env_args[@]}" "$bin_dir/$t" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
    -artifact_prefix="$work/artifacts/$t-" "${extra[@]}" "$corpus" >"$log" 2>&1 || rc=$?
  runs=$(sed -n 's/^Done \([0-9]*\) runs in \([0-9]*\) second.*/\1 executions in \2 s/p' "$log" | tail -n 1)
  corpus_line=$(grep -E '^#[0-9]+[[:space:]]+DONE' "$log" | tail -n 1 | grep -oE 'cov: [0-9]+ ft: [0-9]+ corp: [^ ]+' || true)
  if [ "$rc" -eq 0 ]; then
    echo "fuzz $t: ok, ${runs:-? executions}, ${corpus_line:-no stats}"
  else
    failed+=("$t")
    echo "fuzz $t: FAILED (exit $rc), ${runs:-stopped early}"
    echo "---- what failed"
    grep -m 3 -A 2 -E "panicked at|==ERROR|ERROR: libFuzzer" "$log" || true
    echo "---- last lines of the $t log"
    tail -n 40 "$log"
    mkdir -p "$fuzz_dir/artifacts"
    for a in "$work"/artifacts/"$t"-*; do
      [ -e "$a" ] || continue
      cp "$a" "$fuzz_dir/artifacts/"
      echo "---- input $(basename "$a") ($(wc -c <"$a") bytes), saved to fuzz/artifacts/; base64:"
      base64 -w 0 "$a"
      echo
      echo "reproduce from the repository root: RUSTC_BOOTSTRAP=1 cargo fuzz run $t fuzz/artifacts/$(basename "$a")"
    done
  fi
done

if [ "${#failed[@]}" -ne 0 ]; then
  echo "fuzzing found crashes in: ${failed[*]}" >&2
  exit 1
fi
echo "fuzzing: ${#targets[@]} targets, ${seconds} s each, no crashes ($SECONDS s in all)"
