"""Drop-in classes for the EMA code of other libraries: change one import, keep the rest.

Each module holds the classes of one peer library with the peer's names, signatures,
defaults, methods and state-dict layout, so that the peer's own checkpoint files load both
ways; emakit's update engine runs underneath (planned, sync-free updates), and emakit's
extras are keywords the peer does not have. None of them imports its peer library, except
`emakit.compat.lightning`, whose callback subclasses Lightning's ``Callback``. Each class's docstring lists every difference in behaviour.

========================================  ===================================================
module                                    replaces
========================================  ===================================================
`emakit.compat.timm`                      ``timm.utils.ModelEmaV3``, ``ModelEmaV2``
`emakit.compat.torch_ema`                 ``torch_ema.ExponentialMovingAverage``
`emakit.compat.swa_utils`                 ``torch.optim.swa_utils.AveragedModel``,
                                          ``get_ema_multi_avg_fn``, ``get_ema_avg_fn``
`emakit.compat.diffusers`                 ``diffusers.training_utils.EMAModel``
`emakit.compat.lightning`                 ``lightning.pytorch.callbacks.EMAWeightAveraging``
`emakit.compat.mmengine`                  ``mmengine.model``'s averaged models, for ``EMAHook``
`emakit.compat.ultralytics`               ``ultralytics.utils.torch_utils.ModelEMA`` (YOLO)
========================================  ===================================================

The submodules are imported on use (``from emakit.compat.timm import ModelEmaV3``), never
by ``import emakit.compat``. See docs/migration.md for the one line to change per library.
"""

__all__: list[str] = []
