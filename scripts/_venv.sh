# shellcheck shell=bash
# Sourced helper (scripts/test, scripts/demo, ...): `ensure_venv` creates the
# project's .venv when missing, installs both distributions into it, editable --
# the product pdd-wire (with its test extra) and the tools, pdd-wire-tools
# (tools/, with its demo extra) -- when either install is missing or either
# pyproject.toml changed, and exports VENV=<repo>/.venv.  Returns non-zero,
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

ensure_venv() {
    local venv="$_PDD_ROOT/.venv"
    local stamp="$venv/.pdd-wire-installed"
    local python

    if [[ ! -x $venv/bin/python ]]; then
        if ! python="$(_pdd_find_python)"; then
            local found
            found="$("${PYTHON:-python3}" --version 2>/dev/null | head -n1)" || true
            echo "error: Python >= 3.11 is required (${PYTHON:-python3}: ${found:-not found})." \
                "Install python3.11 or set PYTHON=/path/to/python3.11." >&2
            return 1
        fi
        echo "==> creating $venv with $python ($("$python" --version 2>&1))" >&2
        if ! "$python" -m venv "$venv"; then
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

    if [[ ! -e $stamp || $_PDD_ROOT/pyproject.toml -nt $stamp || $_PDD_ROOT/tools/pyproject.toml -nt $stamp ]] ||
        ! "$venv/bin/python" -c 'import importlib.metadata as m; m.distribution("pdd-wire"); m.distribution("pdd-wire-tools")' \
            2>/dev/null; then
        echo "==> installing pdd-wire (editable, extra 'test') and pdd-wire-tools (editable, extra 'demo') into $venv" >&2
        # One pip run: the tools' dependency on pdd-wire is met by the editable install beside it.
        # shellcheck disable=SC2086  # ${CI:+...} expands to two words or none
        if ! (cd "$_PDD_ROOT" && "$venv/bin/python" -m pip install --disable-pip-version-check \
                ${CI:+--progress-bar off} -e '.[test]' -e './tools[demo]' >&2); then
            echo "error: installing pdd-wire and pdd-wire-tools into $venv failed (see pip's output above)." >&2
            return 1
        fi
        touch "$stamp"
    fi

    export VENV="$venv"
}
