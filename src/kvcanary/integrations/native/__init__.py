"""kvcanary's own engine as a canary host: :mod:`.host` (``install_on_engine``) and
:mod:`.pools` (the attachers for the engine's pools)."""
