#!/usr/bin/env bash
# fuzz/run.sh SECONDS [TARGET...]: builds the fuzz targets (all of them by default) and runs each
# one after the other for SECONDS with libFuzzer, then prints one summary line per target (also
# written to fuzz/target/fuzz-summary.txt). Exits non-zero if a build fails or any target finds a
# crash, a leak, a timeout or runs out of memory; the input that did it is kept under
# fuzz/artifacts/<target>/ and the log under fuzz/target/logs/<target>.log.
#
# Toolchain: nightly with AddressSanitizer when `rustup toolchain list` has a nightly, else the
# default (stable) toolchain without a sanitizer (`-s none`: stable rustc refuses -Zsanitizer).
# Both have coverage feedback, debug assertions and overflow checks; the filter's core has no
# `unsafe`, so ASan mostly costs speed (about 7x fewer executions per second). Override with
# FUZZ_TOOLCHAIN=stable|nightly|<name> and FUZZ_SANITIZER=none|address|...
#
# Corpus: new inputs go to fuzz/corpus/<target>/ (git-ignored, kept between runs); the committed
# seeds in fuzz/seeds/<target>/ and the dictionary fuzz/dicts/<target>.dict are used when present.
# FUZZ_ARGS adds libFuzzer flags. One libFuzzer process per target (no -jobs/-fork).
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { echo "usage: fuzz/run.sh SECONDS [TARGET...]" >&2; exit 2; }
[ $# -ge 1 ] || usage
seconds=$1
shift
[[ $seconds =~ ^[1-9][0-9]*$ ]] || usage

if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "fuzz/run.sh: cargo-fuzz is missing: cargo install --locked cargo-fuzz" >&2
  exit 2
fi

toolchain=${FUZZ_TOOLCHAIN:-}
if [ -z "$toolchain" ] && command -v rustup >/dev/null 2>&1 \
   && grep -q '^nightly' <<<"$(rustup toolchain list)"; then
  toolchain=nightly
fi
cargo_fuzz=(cargo)
[ -n "$toolchain" ] && cargo_fuzz+=("+$toolchain")
cargo_fuzz+=(fuzz)
rustc_version() {
  if [ -n "$toolchain" ]; then rustup run "$toolchain" rustc --version; else rustc --version; fi
}
if [ -z "${FUZZ_SANITIZER:-}" ]; then
  if grep -q nightly <<<"$(rustc_version)"; then FUZZ_SANITIZER=address; else FUZZ_SANITIZER=none; fi
fi
build_flags=(-s "$FUZZ_SANITIZER")

all_targets=$("${cargo_fuzz[@]}" list)
if [ $# -eq 0 ]; then
  # shellcheck disable=SC2206
  targets=($all_targets)
else
  targets=("$@")
  for t in "${targets[@]}"; do
    grep -qx "$t" <<<"$all_targets" || { echo "fuzz/run.sh: no target $t (have: $all_targets)" >&2; exit 2; }
  done
fi

logs=fuzz/target/logs
summary=fuzz/target/fuzz-summary.txt
mkdir -p "$logs"
: >"$summary"
echo "==> fuzz: ${targets[*]}, ${seconds}s each, $(rustc_version), sanitizer $FUZZ_SANITIZER"

# One build for all targets (a cold build is most of a short run's time).
build_start=$SECONDS
if [ $# -eq 0 ]; then
  "${cargo_fuzz[@]}" build "${build_flags[@]}"
else
  for t in "${targets[@]}"; do "${cargo_fuzz[@]}" build "${build_flags[@]}" "$t"; done
fi
echo "==> fuzz: built in $((SECONDS - build_start))s"

final_stat() { sed -n "s/^stat::$1: *//p" "$2" | tail -1; }

failed=()
for t in "${targets[@]}"; do
  corpus=fuzz/corpus/$t
  mkdir -p "$corpus" "fuzz/artifacts/$t"
  dirs=("$corpus")
  [ -d "fuzz/seeds/$t" ] && dirs+=("fuzz/seeds/$t")
  flags=(-max_total_time="$seconds" -rss_limit_mb=2048 -timeout=30 -print_final_stats=1)
  [ -f "fuzz/dicts/$t.dict" ] && flags+=(-dict="fuzz/dicts/$t.dict")
  # shellcheck disable=SC2206
  flags+=(${FUZZ_ARGS:-})
  log=$logs/$t.log
  echo "==> fuzz: $t for ${seconds}s (log: $log)"
  start=$SECONDS
  set +e
  "${cargo_fuzz[@]}" run "${build_flags[@]}" "$t" "${dirs[@]}" -- "${flags[@]}" >"$log" 2>&1
  rc=$?
  set -e
  took=$((SECONDS - start))
  execs=$(final_stat number_of_executed_units "$log")
  rate=$(final_stat average_exec_per_sec "$log")
  files=$(find "$corpus" -type f | wc -l)
  if [ "$rc" -eq 0 ]; then
    result=ok
  else
    result="FAILED (exit $rc)"
    artifact=$(sed -n 's/.*Test unit written to \(.*\)$/\1/p' "$log" | tail -1)
    [ -n "$artifact" ] && result+=", input: $artifact, replay: cargo ${toolchain:++$toolchain }fuzz run ${build_flags[*]} $t $artifact"
    failed+=("$t")
  fi
  line="fuzz: $t: ${took}s, ${execs:-?} executions (${rate:-?}/s), corpus $files files, $result"
  echo "$line" | tee -a "$summary"
  if [ "$rc" -ne 0 ]; then
    echo "---- last lines of $log:" >&2
    grep -v '^#[0-9]' "$log" | tail -40 >&2
  fi
done

if [ ${#failed[@]} -ne 0 ]; then
  echo "fuzz/run.sh: FAILED: ${failed[*]}" >&2
  exit 1
fi
echo "fuzz/run.sh: all ${#targets[@]} targets ran ${seconds}s without a failure"
