"""Before torchrun starts: the rendezvous port is free here, and the main machine answers.

torchrun reports both problems late and deep: a port held by another job fails the main
machine's TCPStore with a C++ traceback, and a main_process_ip that does not answer keeps the
other machines waiting for the rendezvous timeout (600 s by default), then fails with another.
`retarget launch` checks first and says which address and which setting to change:

- `check_port_free`: on the machine that hosts the static rendezvous (machine_rank 0), bind the
  port the way TCPStore will; in use -> LaunchError before anything starts.
- `wait_for_main`: on the other machines, connect to main_process_ip:port until it accepts or
  `--join_timeout` seconds pass (the main machine may start a little later); a name that does
  not resolve is an error at once.
"""

from __future__ import annotations

import errno
import socket
import sys
import time

from retarget.launch.config import LaunchError

#: Seconds a machine waits for the main machine when --join_timeout is not set (torchrun's own).
DEFAULT_JOIN_TIMEOUT_S = 600
#: Seconds between two connection attempts.
RETRY_S = 1.0


def check_port_free(port: int, origin: str) -> None:
    """Raise LaunchError when `port` cannot be listened on here (another process holds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        # As TCPStore does: a port in TIME_WAIT from an earlier run is free to take.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
            probe.listen(1)
        except OSError as error:
            if error.errno != errno.EADDRINUSE:
                raise LaunchError(f"{origin} {port} cannot be listened on: {error}") from None
            raise LaunchError(
                f"{origin} {port} is already in use on this machine (another job's "
                "rendezvous?): choose another port, or leave it unset on one machine to take a "
                "free one"
            ) from None


def wait_for_main(ip: str, port: int, timeout_s: float, origin: str) -> float:
    """Connect to the main machine's rendezvous until it answers; the seconds waited.

    Raises LaunchError naming the address when it does not resolve, or does not answer within
    `timeout_s`.
    """
    started = time.monotonic()
    deadline = started + timeout_s
    said = False
    while True:
        remaining = deadline - time.monotonic()
        try:
            with socket.create_connection((ip, port), timeout=max(0.1, min(5.0, remaining))):
                return time.monotonic() - started
        except socket.gaierror as error:
            raise LaunchError(f"{origin} {ip!r} does not resolve to an address: {error}") from None
        except OSError as error:
            last = error
        if time.monotonic() + RETRY_S > deadline:
            raise LaunchError(
                f"the main machine at {ip}:{port} ({origin}) did not answer within "
                f"{timeout_s:g} s ({last.strerror or last}): start machine 0 first or with this "
                "one, check the address and that the port is open between the machines, or "
                "raise --join_timeout"
            )
        if not said:
            print(
                f"retarget launch: waiting for the main machine at {ip}:{port} "
                f"(up to {timeout_s:g} s)",
                file=sys.stderr,
                flush=True,
            )
            said = True
        time.sleep(RETRY_S)
