#!/usr/bin/env bash
# A newcomer's first steps, from a fresh clone: the README's first command, one example, one CLI
# call and one REPL line (typed through a pseudo-terminal by `script`). Any step that fails, or
# prints something other than what it should, stops the script with a message and exit 1.
#
#   scripts/newcomer.sh [SOURCE]     SOURCE: the repository to clone (default: this one)
#
# NEWCOMER_VENV=/path/to/venv (what CI's test sets, tests/test_first_hour_newcomer.py) reuses an
# installed virtual environment instead of installing torch and the rest again: the README's
# first command then runs without its `python3 -m venv` and `pip install` parts, with `.venv`
# linked to that environment and PYTHONPATH set to the clone, so every step still runs the
# clone's code (checked below), only not its installation. Without it, the README's first
# command runs exactly as written, install included (minutes, and torch's download).
# NEWCOMER_STEP_TIMEOUT (seconds, default 300) bounds each step.
set -euo pipefail

SOURCE="${1:-$(cd "$(dirname "$0")/.." && pwd)}"
STEP_TIMEOUT="${NEWCOMER_STEP_TIMEOUT:-300}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/stemma-newcomer.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

say() { printf 'newcomer: %s\n' "$*"; }
fail() { printf 'newcomer: FAILED: %s\n' "$*" >&2; exit 1; }
expect() {  # expect FILE REGEX WHAT: FILE must match the extended regex
    grep -Eq -- "$2" "$1" || { sed 's/^/    /' "$1" | tail -40 >&2; fail "$3"; }
}
step() {  # step NAME OUTFILE COMMAND...: runs it bounded by STEP_TIMEOUT, output into OUTFILE
    local name="$1" out="$2"; shift 2
    say "$name"
    local start=$SECONDS
    if ! timeout "$STEP_TIMEOUT" "$@" >"$out" 2>&1; then
        sed 's/^/    /' "$out" | tail -40 >&2
        fail "$name (exit status or timeout after $((SECONDS - start)) s)"
    fi
    say "  done in $((SECONDS - start)) s"
}

say "cloning $SOURCE"
git clone --quiet "$SOURCE" "$WORK/stemma"
cd "$WORK/stemma"

# The README's first command: the first line of its first ```bash block.
FIRST="$(awk '/^```bash/{inside=1; next} inside{print; exit}' README.md)"
[ -n "$FIRST" ] || fail "the README has no first command"
if [ -n "${NEWCOMER_VENV:-}" ]; then
    [ -x "$NEWCOMER_VENV/bin/python" ] || fail "NEWCOMER_VENV=$NEWCOMER_VENV has no bin/python"
    ln -s "$NEWCOMER_VENV" .venv
    export PYTHONPATH="$PWD"
    .venv/bin/python -c "import stemma, sys; sys.exit(not stemma.__file__.startswith('$PWD/'))" \
        || fail "the reused environment does not import the clone's stemma"
    # drop the parts that make and fill .venv; run the rest as written
    kept=()
    while IFS= read -r part; do
        case "$part" in "python3 -m venv"*|*"pip install"*) ;; *) kept+=("$part") ;; esac
    done < <(printf '%s\n' "${FIRST// && /$'\n'}")
    FIRST="$(printf '%s && ' "${kept[@]}")"
    FIRST="${FIRST% && }"
fi
export TERM=xterm PROMPT_TOOLKIT_NO_CPR=1 COLUMNS=120 LINES=40

step "the README's first command: $FIRST" "$WORK/first.out" bash -c "$FIRST"
expect "$WORK/first.out" '^(positive|negative) ' "few_shot_select printed no labels"
expect "$WORK/first.out" 'came from the prefix cache' "few_shot_select printed no cache figures"

step "an example: stemma run examples/qa.stm" "$WORK/example.out" \
    .venv/bin/python -m stemma run examples/qa.stm --var question="What is the capital of France?"
expect "$WORK/example.out" 'model calls' "stemma run printed no usage line"

step "a CLI call: stemma generate" "$WORK/cli.out" \
    .venv/bin/python -m stemma generate "The capital of France is" --max-new-tokens 8
expect "$WORK/cli.out" '^The capital of France is ?[^ ].*[a-z]' "stemma generate did not continue the prompt"
expect "$WORK/cli.out" 'model ready in [0-9.]+s \| 8 tokens' "stemma generate printed no stats line"

# One REPL line through a pseudo-terminal: the input is typed ahead, then :quit.
step "a REPL line: stemma repl" "$WORK/repl.out" bash -c \
    "printf 'The capital of France is\r:quit\r' | script -qefc '.venv/bin/python -m stemma repl --history \"\" --max-new-tokens 8' /dev/null"
expect "$WORK/repl.out" 'stemma repl: a plain prompt continues the text' "the REPL printed no banner"
tr -d '\r' <"$WORK/repl.out" | sed 's/\x1b\[[0-9;?]*[A-Za-z]//g' >"$WORK/repl.txt"
expect "$WORK/repl.txt" 'stemma> The capital of France is' "the REPL did not echo the line"
if grep -q 'error' "$WORK/repl.txt"; then sed 's/^/    /' "$WORK/repl.txt" >&2; fail "the REPL reported an error"; fi
[ "$(grep -o 'stemma> ' "$WORK/repl.txt" | wc -l)" -ge 2 ] || fail "the REPL did not come back to its prompt"
awk '/stemma> The capital of France is/ { getline; print; exit }' "$WORK/repl.txt" >"$WORK/repl.continuation"
expect "$WORK/repl.continuation" '[a-z]{3}' "the REPL printed no continuation of the line"

say "all steps passed"
