"""The cluster tier below the node: pages written behind to Mooncake Store and promoted back.

- ``tier``     ``ClusterTier``: the handlers' calls, its lifecycle, the worker loop.
- ``state``    what the loop and the worker share, and the index calls the worker asks of
               the loop; the worker's modules below import this, never ``tier``.
- ``io``       connect, write-behind puts, existence probes (worker thread).
- ``promote``  fetching pages into a namespace, round by round (worker thread).
- ``verify``   what a fetched value is: a page to commit, missing, failed or refused.
- ``health``   whether the tier is up, and for how long it stays down.
- ``drop``     a dropped namespace leaving the tier.

May import: ``store``, ``conf``, ``hisparse.cluster`` (the value format, the Mooncake client).
"""
