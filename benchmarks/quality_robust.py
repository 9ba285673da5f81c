"""`python -m benchmarks.quality_robust`: quality from a warm start and with a second seed."""

from benchmarks.quality import run_robust
from benchmarks.report import standalone

if __name__ == "__main__":
    standalone(run_robust)
