#!/usr/bin/env bash
# The test suite at both ends of the supported transformers range (5.17 and the newest 5.x that installs), and the
# installed-wheel check (scripts/check_install.sh). Every part runs even when an earlier one fails; the script
# reports each part and exits non-zero at the end if any failed. Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh .venv 5.25.0
bash scripts/setup_env.sh .venv-5.17 5.17.0

logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
summary=()
failed=0

echo "== installed wheel (transformers 5.25.0) =="
if bash scripts/check_install.sh 5.25.0; then
    summary+=("installed wheel: passed")
else
    summary+=("installed wheel: FAILED (scripts/check_install.sh, output above)")
    failed=1
fi

for end in "5.25.0 .venv" "5.17.0 .venv-5.17"; do
    read -r version venv <<< "$end"
    echo "== transformers $version =="
    status=0
    "$venv/bin/python" -m pytest -q "$@" 2>&1 | tee "$logs/pytest-$version.log" || status=$?
    # pytest's own last line ("N passed, M skipped in S") is the part's result, repeated in the summary below.
    summary+=("transformers $version: $(tail -n 1 "$logs/pytest-$version.log")")
    [ "$status" -eq 0 ] || failed=1
done

echo "== summary =="
printf '%s\n' "${summary[@]}"
exit "$failed"
