"""hisparsed, the node daemon: one process owning the node's KV host memory and its page metadata.

The folders are the architecture, lowest layer first; each imports only from the
layers below it (and names above it for type hints alone):

- ``conf/``     the configuration: embedded defaults < TOML file < environment < flags.
- ``policy/``   who may do what: trusted files, group access, peers (SO_PEERCRED),
                caps on sessions and connections, quotas on pages.
- ``store/``    what the daemon owns: namespaces and their regions, the page index and
                eviction, sessions, their holds and fences, adoption after a restart.
- ``cluster/``  the tier below the node (Mooncake Store): write-behind and promotion.
- ``ops/``      one handler per op on the wire, and the context every handler gets.
- ``front/``    what faces the outside: the ZeroMQ loop, connections, fair turns,
                replies, timers, systemd notification, the metrics endpoint.

``main.py`` (the ``hisparsed`` command) wires them together in start-up order.
Nothing here imports torch or any engine.
"""
