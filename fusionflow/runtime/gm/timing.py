"""The clocks of the global-manager protocol, in one place: the GM (runtime/gm/manager.py), a
local manager's seat at its table (runtime/gm/link.py) and the table itself (runtime/gm/tables.py)
all reason about the same times, so each is defined once here (the sockets' own bounds are
runtime/authsock.py's, which every socket user shares). Imports nothing from the package:
it sits below the tables, the link and the manager.

Two start-up windows, on purpose of different lengths:
  START_S     a table's creator spawned a GM that has not claimed the table yet: for this long
              the table counts as having a live GM (`Tables.gm_alive`), and a GM that no LM ever
              registered with exits after it.
  GM_START_S  an LM that joined a table whose GM has not claimed it within this reports the GM
              lost once and keeps training without lending (`GMLink.check_gm`).
"""

from fusionflow.runtime.userdir import env_number

START_S = 30.0
GM_START_S = 10.0
LIVENESS_S = 0.25  # how often pids are checked: GM for its LMs, an LM for its GM (a /proc read each)
POLL_S = 0.002  # the GM's loop period
# no LM registered for this long: the job's loaders are gone (not just between two epochs)
LINGER_S = env_number("FUSIONFLOW_GM_LINGER_S", 2.0, float, " (seconds a job's global manager waits for a loader)")
INCOMING_TTL_S = 1.0  # workers lent but never accepted within this are written off
STALE_S = 2.0  # an LM whose row has not been published for this long neither lends nor borrows
GM_SILENT_S = 10.0  # a GM whose heartbeat is this old (stopped, hung) counts as gone, though its pid lives
# A GM's doorbell not hung on an LM (it does not accept: hung, or stopped, and then not tried while it stays so) is
# tried again after BELL_RETRY_S, doubling up to BELL_RETRY_MAX_S, counted from the end of each try: a try may wait
# out the handshake's bound, and a retry due at once held the GM's whole loop in handshakes (a 1000-fold slower GM).
BELL_RETRY_S = 1.0
BELL_RETRY_MAX_S = 16.0
