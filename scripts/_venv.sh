# shellcheck shell=bash
# Sourced helper (scripts/test, scripts/demo, scripts/bench): `ensure_venv` creates
# the project's .venv when missing, installs both distributions into it, editable -- the
# product pdd-wire (extras test and ucx) and the tools, pdd-wire-tools (tools/, extra demo),
# pinned by constraints.txt -- when either install is missing or either pyproject.toml or
# constraints.txt changed, and exports VENV=<repo>/.venv.  One line of progress per step;
# pip's output goes to .venv/install.log and is shown only on failure.  Returns non-zero,
# with a message, on failure.

_PDD_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# Print the path of a Python >= 3.11: $PYTHON if set, else the first found.
_pdd_find_python() {
    local candidate
    for candidate in ${PYTHON:-python3.11 python3.12 python3.13 python3}; do
        command -v "$candidate" >/dev/null 2>&1 || continue
        if "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
            command -v "$candidate"
            return 0
        fi
    done
    return 1
}

# Run "$@" with its output in the log file $1 (appended); on failure show the log's last lines.
_pdd_logged() {
    local log="$1"
    shift
    if ! "$@" >>"$log" 2>&1; then
        echo "error: '$*' failed; the last lines of $log:" >&2
        tail -n 40 "$log" | sed 's/^/    /' >&2
        return 1
    fi
}

ensure_venv() {
    local venv="$_PDD_ROOT/.venv"
    local stamp="$venv/.pdd-wire-installed"
    local log="$venv/install.log"
    local python

    if [[ ! -x $venv/bin/python ]]; then
        if ! python="$(_pdd_find_python)"; then
            local found
            found="$("${PYTHON:-python3}" --version 2>/dev/null | head -n1)" || true
            echo "error: Python >= 3.11 is required (${PYTHON:-python3}: ${found:-not found})." \
                "Install python3.11 or set PYTHON=/path/to/python3.11." >&2
            return 1
        fi
        echo "==> creating .venv with $("$python" --version 2>&1) ($python)" >&2
        if ! "$python" -m venv "$venv" 2>/dev/null; then
            rm -rf "$venv"  # a half-made venv (no pip) would be reused next time
            echo "error: '$python -m venv' failed; on Debian/Ubuntu install python3-venv." >&2
            return 1
        fi
    fi

    if ! "$venv/bin/python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
        echo "error: $venv runs $("$venv/bin/python" --version 2>&1 || echo 'a broken Python')," \
            "but Python >= 3.11 is required; remove $venv and rerun." >&2
        return 1
    fi

    if [[ ! -e $stamp || $_PDD_ROOT/pyproject.toml -nt $stamp || $_PDD_ROOT/tools/pyproject.toml -nt $stamp ||
          $_PDD_ROOT/constraints.txt -nt $stamp ]] ||
        ! "$venv/bin/python" -c 'import importlib.metadata as m; m.distribution("pdd-wire"); m.distribution("pdd-wire-tools")' \
            2>/dev/null; then
        # The daemon's dependencies at the versions in constraints.txt (scripts/lock writes it),
        # with the extras the tests use; the tools beside it (one pip run: the tools' dependency
        # on pdd-wire is met by the editable install).
        echo "==> installing pdd-wire[test,ucx] and pdd-wire-tools[demo] into .venv, pinned by constraints.txt" \
            "(1-2 minutes; log: .venv/install.log)" >&2
        : >"$log"
        _pdd_logged "$log" "$venv/bin/python" -m pip install --disable-pip-version-check --progress-bar off \
            -c "$_PDD_ROOT/constraints.txt" -e "$_PDD_ROOT[test,ucx]" -e "$_PDD_ROOT/tools[demo]" || return 1
        touch "$stamp"
    fi

    export VENV="$venv"
}
