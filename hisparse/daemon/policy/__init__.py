"""Who may do what: the daemon's rules, each a check the layers above call.

- ``trust``      which files and directories the daemon may trust (its own, no one else's).
- ``access``     which group may attach to a namespace, proven to the kernel.
- ``peers``      who is on the other end of a connection (SO_PEERCRED).
- ``proclocks``  which processes hold a fence's lock, from ``/proc``.
- ``limits``     caps on sessions, connections and descriptors, each by its config key.
- ``backoff``    which processes (then uids) sit out a backoff for refused large frames.
- ``quotas``     what one session and one peer may pin or reserve of a namespace.
- ``contention`` whether those shares bind now (another uid attached, another session short).

May import: ``conf`` and ``hisparse`` core modules; names from ``store`` and ``ops`` for type
hints only (a quota is checked against a session and a namespace it is handed).
"""
