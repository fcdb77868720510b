"""The process's resident set from ``/proc/self/status`` (Linux), with no import beyond the stdlib.

Kept apart so that a memory child can read it before it imports the library
it measures: qkvnp's, numpy's or PyTorch's modules would otherwise count in
its baseline.
"""

__all__ = ["proc_status_kib", "reset_peak_rss"]


def proc_status_kib(field):
    """``field`` of ``/proc/self/status`` (``"VmRSS"``, ``"VmHWM"``) in KiB; ``OSError`` if absent."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"/proc/self/status has no {field}")


def reset_peak_rss():
    """Reset the kernel's peak-RSS counter (``VmHWM``); return False where that is impossible."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        proc_status_kib("VmHWM")
        return True
    except OSError:
        return False
