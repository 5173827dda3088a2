"""The user-facing API: ``attach``, ``shard``, ``Session`` (issue 11; DESIGN "What the user does")."""
