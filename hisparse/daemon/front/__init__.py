"""What faces the outside: the ZeroMQ loop, its connections, replies, timers, systemd, metrics.

- ``server``       the loop: a ROUTER on an ``ipc://`` socket driven by asyncio.
- ``dispatch``     one frame in, one reply out: decode, route to ``ops``, never raise.
- ``connections``  connections counted from the socket's monitor, refused past their caps;
                   ``door`` closes the door before descriptors run out, ``uid_door`` to one
                   storming uid alone; ``shedding`` sheds only the connection meant.
- ``fairness``     requests read but not served yet: turns per uid, then per connection.
- ``outbox``       replies on their way out, bounded per peer, never blocking the loop.
- ``timers``       the lease reaper, the watchdog, the descriptor recount.
- ``notify``       systemd notification (READY, WATCHDOG, STOPPING).
- ``metrics``      the Prometheus endpoint.

May import: every layer below (``ops`` and down).
"""
