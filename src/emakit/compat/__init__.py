"""Drop-in classes for the users of other EMA libraries: the peer's name, signature,
defaults, methods and checkpoint files, with emakit's engine underneath.

Each peer has its own module, imported only when asked for (``import emakit.compat``
imports none of them, nor any peer):

* `emakit.compat.diffusers`: ``EMAModel`` (diffusers' ``training_utils.EMAModel``);
* `emakit.compat.lightning`: ``EMAWeightAveraging`` (Lightning's callback).
"""
