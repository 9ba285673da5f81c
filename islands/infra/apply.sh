#!/usr/bin/env bash
# Create the work pools islands/infra/prefect.yaml names, then register its deployments, with Prefect's
# own CLI against the server in PREFECT_API_URL.
#   islands/infra/apply.sh process      one machine (or one VM per region): `prefect worker start --pool islands-<region>`
#   islands/infra/apply.sh kubernetes   Kubernetes jobs from islands/infra/k8s/base-job-template.json (workers need prefect-kubernetes)
set -euo pipefail
kind="${1:-process}"
infra="$(cd "$(dirname "$0")" && pwd)"
root="$(dirname "$(dirname "$infra")")"
python="${PYTHON:-python}"
case "$kind" in
  process) template=() ;;
  kubernetes) template=(--base-job-template "$infra/k8s/base-job-template.json") ;;
  *) echo "apply.sh: pool type must be process or kubernetes, got '$kind'" >&2; exit 2 ;;
esac
: "${PREFECT_API_URL:?set PREFECT_API_URL to the shared Prefect server, e.g. https://prefect.example.com/api}"

pools=$("$python" -c 'import sys, yaml; print(*(p["name"] for p in yaml.safe_load(open(sys.argv[1]))["definitions"]["work_pools"].values()))' "$infra/prefect.yaml")
for pool in $pools; do
  "$python" -m prefect --no-prompt work-pool create "$pool" --type "$kind" "${template[@]}" --overwrite
done
cd "$root"
"$python" -m prefect --no-prompt deploy --all --prefect-file islands/infra/prefect.yaml
