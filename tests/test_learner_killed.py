"""A learner the kernel killed (SIGKILL, the OOM killer's way) is reported with what to change."""

import pytest

from islands.flows.learner_watch import OOM_HINT, death


@pytest.mark.parametrize(
    "message",
    [
        "Flow run infrastructure exited with non-zero status code -9. Process exited due to a signal.",
        "Process for flow run 'learner-north-0' exited with exit code -9",
        "Flow run process exited with exit code 137",
        "The process was terminated by signal 9",
        "Crash detected! Execution was interrupted by SIGKILL",
    ],
)
def test_a_crash_by_sigkill_says_it_was_likely_out_of_memory_and_what_to_lower(message):
    why = death("Crashed", message)
    assert why == f"Crashed: {message}; {OOM_HINT}"
    assert "inner.micro_batch_size" in why and "fewer learners per machine" in why


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ("Crashed", "Flow run process exited with exit code 1"),
        ("Crashed", "Process exited with exit code 1379"),
        ("Crashed", "Flow run infrastructure exited with non-zero status code 1."),
        ("Failed", "ValueError: exit code -9 in a message of the flow's own"),
        ("Crashed", None),
    ],
)
def test_other_deaths_get_no_memory_hint(state, message):
    assert OOM_HINT not in death(state, message)
