"""The learner's write-behind keeps the contract's order and never swallows a failed upload."""

import threading
import time

import pytest

from islands.tasks.write_behind import WriteBehind


def test_uploads_run_in_submission_order_while_the_caller_goes_on():
    uploads, done, gate = WriteBehind(), [], threading.Event()
    uploads.submit(lambda: (gate.wait(5), done.append("delta-0")))
    uploads.submit(lambda: done.append("state-0"))
    assert done == []  # the caller was not held up by the first upload
    gate.set()
    uploads.submit(lambda: done.append("delta-1"))
    uploads.close()
    assert done == ["delta-0", "state-0", "delta-1"]


def test_a_failed_upload_is_raised_at_the_next_submit_or_flush():
    uploads = WriteBehind()

    def fail():
        raise OSError("S3 said no")

    uploads.submit(fail)
    time.sleep(0.1)
    with pytest.raises(OSError, match="S3 said no"):
        uploads.submit(lambda: None)
    uploads.submit(fail)
    with pytest.raises(OSError, match="S3 said no"):
        uploads.flush()
    uploads.flush()  # each failure is raised once


def test_with_a_limit_a_submit_waits_for_the_oldest_job_so_one_phase_is_on_its_way_up():
    uploads, done, gate = WriteBehind(limit=1), [], threading.Event()
    uploads.submit(lambda: (gate.wait(5), done.append("phase-0")))
    threading.Timer(0.2, gate.set).start()
    uploads.submit(lambda: done.append("phase-1"))  # returns once phase 0's job has finished
    assert done[:1] == ["phase-0"]
    uploads.close()
    assert done == ["phase-0", "phase-1"]
