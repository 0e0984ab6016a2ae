"""One handler per op on the wire, and what every handler gets.

- ``handlers``     the dispatch table: op -> handler.
- ``context``      ``DaemonContext`` (config, namespaces, sessions, access, counters) and
                   ``Deferred``, the reply that waits.
- ``hello``        opening a session (attaching or creating a namespace).
- ``writes``       reserve, commit, abort, pin, unpin, publish, run in ``slicing`` slices.
- ``stats``, ``sessionrows``  what ``hisparsectl stats`` and ``sessions`` show.
- ``admin``, ``governance``   admin ops: clear, evict a session, shut down, drop.
- ``sweep``        the start-up fence sweep, a slice at a time while serving.
- ``opstats``      what the request path counts for the metrics endpoint.

May import: ``cluster``, ``store``, ``policy``, ``conf`` and ``hisparse.protocol``.
"""
