"""torchrun mode (``torchrun --nproc-per-node N -m pytest ...``, on one node or several): the per-rank
session plugin (``session``), the rendezvous-store connection (``link``), where each rank runs
(``placement``) and its directories (``dirs``), heartbeats (``liveness``), each rank's watchdog
thread (``watchdog``) and rank 0's reporting (``reporter``); ``state`` names what the main thread
is doing. Imported only under torchrun (``harness.plugin`` picks the mode)."""
