"""torchrun mode (``torchrun --nproc-per-node N -m pytest ...``): the per-rank session plugin
(``session``), the rendezvous-store connection and peers (``link``), each rank's watchdog thread
(``watchdog``) and rank 0's reporting (``reporter``); ``state`` names what the main thread is doing.
Imported only under torchrun (``harness.plugin`` picks the mode)."""
