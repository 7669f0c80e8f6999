"""Save and restore params, optimizer state and FP8 state with orbax.

FP8 scale state is ordinary f32 arrays in the train state's pytree, so
orbax's standard pytree handler saves it with everything else and a restored
run continues bit for bit. These helpers only pick the orbax calls: one
``CheckpointManager`` per call, a step-numbered directory per save, and a
restore shaped like a template you pass in.
"""

from __future__ import annotations

import operator
import os
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx


def _manager(directory, max_to_keep: int | None = None, **kwargs) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
    return ocp.CheckpointManager(os.path.abspath(directory), options=options, **kwargs)


def _shapes_by_path(tree) -> dict[str, tuple[int, ...]]:
    """Each array leaf's shape by its path (``params/kernel``), the same for orbax's metadata."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {
        jax.tree_util.keystr(path, simple=True, separator="/"): tuple(leaf.shape)
        for path, leaf in leaves
        if hasattr(leaf, "shape")
    }


def _check_shapes(manager: ocp.CheckpointManager, step: int, abstract, directory) -> None:
    """Raises if an array of checkpoint ``step`` has another shape than ``abstract``'s.

    Orbax's own error names no array, and the reads it left in flight print
    an "Event loop is closed" traceback each; the metadata is read before any
    array. A tree that differs in its paths is left to orbax, whose error
    lists them.
    """
    try:
        stored = _shapes_by_path(manager.item_metadata(step).tree)
    except Exception:  # unreadable metadata: the restore itself reports it
        return
    wanted = _shapes_by_path(abstract)
    diffs = [
        f"{path}: checkpoint {stored[path]}, like {shape}"
        for path, shape in wanted.items()
        if path in stored and stored[path] != shape
    ]
    if diffs:
        raise ValueError(
            f"checkpoint.restore: step {step} under {str(directory)!r} does not fit `like`: "
            f"{len(diffs)} arrays differ in shape ({'; '.join(diffs[:3])}"
            f"{'; ...' if len(diffs) > 3 else ''}). Pass a template of the model and "
            "optimizer that were saved."
        )


def save(directory, step: int, tree: Any, *, max_to_keep: int | None = None) -> None:
    """Writes ``tree`` as checkpoint ``step`` under ``directory`` and waits for it.

    Args:
      directory: the run's checkpoint directory (created if missing).
      step: the step number; one subdirectory per step.
      tree: any pytree of arrays, e.g. a :class:`fp8jax.flax.TrainState`.
      max_to_keep: keep only this many newest checkpoints (None keeps all).

    Raises:
      TypeError: if ``step`` is not an int.
      ValueError: if ``step`` is negative, or not after the newest step already
        in ``directory`` (orbax writes only steps after its newest, and would
        skip any other without a word).

    Example:
      >>> import tempfile, jax.numpy as jnp
      >>> from fp8jax.flax import checkpoint
      >>> d = tempfile.mkdtemp()
      >>> checkpoint.save(d, 3, {"w": jnp.arange(4.0)})
      >>> checkpoint.restore(d, {"w": jnp.zeros(4)})["w"].tolist()
      [0.0, 1.0, 2.0, 3.0]
    """
    try:
        if isinstance(step, bool):
            raise TypeError
        step = operator.index(step)  # an int, or an integer scalar such as state.step
    except TypeError:
        raise TypeError(f"checkpoint.save: step must be an int >= 0, got {step!r}.") from None
    if step < 0:
        raise ValueError(f"checkpoint.save: step must be an int >= 0, got {step}.")
    with _manager(directory, max_to_keep) as manager:
        newest = manager.latest_step()
        if newest is not None and step <= newest:
            raise ValueError(
                f"checkpoint.save: step {step} cannot be written: {str(directory)!r} already "
                f"holds step {newest}, and orbax writes only steps after its newest (it would "
                f"skip this save). Save under a step > {newest}, use another directory, or "
                "delete the newer steps' folders to roll back."
            )
        manager.save(step, args=ocp.args.StandardSave(tree))
        manager.wait_until_finished()


def latest_step(directory) -> int | None:
    """The newest step saved under ``directory``, or None."""
    with _manager(directory) as manager:
        return manager.latest_step()


def restore(directory, like: Any, step: int | None = None) -> Any:
    """Reads checkpoint ``step`` (default: the newest) shaped like ``like``.

    Args:
      directory: the run's checkpoint directory.
      like: a pytree with the structure, shapes and dtypes to restore, such
        as a freshly created train state (its values are not used) or
        ``jax.eval_shape`` of one.
      step: which step; None for the newest.

    Returns:
      The restored pytree.

    Raises:
      FileNotFoundError: if ``directory`` holds no checkpoint (or not ``step``).
      ValueError: if an array of the checkpoint has another shape than in ``like``.
    """
    with _manager(directory, item_handlers=ocp.StandardCheckpointHandler()) as manager:
        steps = manager.all_steps()
        step = manager.latest_step() if step is None else step
        if step is None or step not in steps:
            raise FileNotFoundError(
                f"no checkpoint for step {step} under {directory!r}; saved steps: {sorted(steps)}."
            )
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        _check_shapes(manager, step, abstract, directory)
        return manager.restore(step, args=ocp.args.StandardRestore(abstract))


def save_nnx(directory, step: int, *nodes: Any, max_to_keep: int | None = None) -> None:
    """Saves the state of NNX objects (a model, its ``nnx.Optimizer``) as one checkpoint.

    Everything in them is saved: params, :class:`~fp8jax.flax.nnx.Fp8State`,
    optimizer state and step, RNG state.
    """
    save(directory, step, nnx.to_pure_dict(nnx.state(nodes)), max_to_keep=max_to_keep)


def restore_nnx(directory, *nodes: Any, step: int | None = None) -> None:
    """Restores :func:`save_nnx`'s checkpoint into the same kind of NNX objects, in place.

    Example:
      >>> import tempfile, jax.numpy as jnp, optax
      >>> from flax import nnx
      >>> from fp8jax.flax import checkpoint, nnx as fnnx
      >>> d = tempfile.mkdtemp()
      >>> model = fnnx.DenseGeneral(8, 4, rngs=nnx.Rngs(0))
      >>> optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
      >>> checkpoint.save_nnx(d, 0, model, optimizer)
      >>> fresh = fnnx.DenseGeneral(8, 4, rngs=nnx.Rngs(1))
      >>> fresh_opt = nnx.Optimizer(fresh, optax.adam(1e-3), wrt=nnx.Param)
      >>> checkpoint.restore_nnx(d, fresh, fresh_opt)
      >>> bool((fresh.kernel[...] == model.kernel[...]).all())
      True
    """
    state = nnx.state(nodes)
    restored = restore(directory, nnx.to_pure_dict(state), step)
    nnx.replace_by_pure_dict(state, restored)
    nnx.update(nodes, state)
