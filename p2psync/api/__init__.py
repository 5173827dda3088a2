"""The user-facing facade: ``attach``, ``shard`` and ``Session`` for a user's own training script,
and the environment contract (``p2psync.api.env``) through which ``p2psync run ... -- CMD``
tells each started script which node of which run it is."""
