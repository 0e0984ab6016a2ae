"""What the daemon owns: namespaces, their regions and pages, and the sessions that hold them.

- ``namespaces``  the registry: creating, sizing, charging and dropping namespaces.
- ``regiondir``   the daemon's own region directory under ``shm_dir``.
- ``adoption``    taking over what an earlier run left (or ``--fresh`` removing it).
- ``index``       one namespace's page index: key -> page, page states (the metadata table
                  is the source of truth); ``pincount``, ``eviction`` (LRU) and ``index_log``
                  (counters, the event log) are its parts.
- ``sessions``    sessions, their holds, and the fences that outlive them; ``calltags``
                  records what each client call took.
- ``background``  the priority of the threads that allocate regions off the loop.

May import: ``policy``, ``conf``, ``hisparse.shm`` and core modules.
"""
