"""Cross-field rules of the model spec: references, DAG shape, and shape inference.

Shape inference is also what the graph builder uses, so it lives with the contract.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from spindle_cli.artifacts.codec import field_path
from spindle_cli.errors import FieldError, has_control

if TYPE_CHECKING:
    from spindle_cli.artifacts.model import ModelSpec, TaskSpec

LOSS_KINDS = ("contrastive_loss", "lm_loss")


def article(word: str) -> str:
    """'a' or 'an' before `word` as it is read ('an embedding', 'an lm_loss', 'a projection')."""
    return "an" if word[:1] in "aeiou" or word.startswith("lm") else "a"


def targets_name(loss_step: str) -> str:
    """The data item holding the targets of an `lm_loss` step (beside the task's inputs)."""
    return f"{loss_step}:targets"


def _check_label(name: str, path: str, what: str) -> None:
    """A name that errors quote: not blank, and no line break or control character
    (`codec.NAME_PATTERN`'s rule: a no-break space is fine)."""
    if not name.strip():
        raise FieldError(path, f"a {what} needs a name")
    if has_control(name):
        raise FieldError(path, f"{name!r}: a {what} name must not hold line breaks or control "
                               f"characters (it names the {what} in one-line errors)")


def _check_name(name: str, path: str, what: str) -> None:
    """A task or step name: MetaOps are named `task/step` and `--tasks` takes names separated
    by commas (each stripped of spaces), so neither may hold '/' or ',' or begin or end with a
    space, besides `_check_label`'s rule."""
    _check_label(name, path, what)
    if "/" in name:
        raise FieldError(path, f"{name!r}: a {what} name cannot hold '/' (MetaOps are named "
                               "task/step)")
    if "," in name:
        raise FieldError(path, f"{name!r}: a {what} name cannot hold ',' (--tasks separates "
                               "names with commas)")
    if name != name.strip():
        raise FieldError(path, f"{name!r}: a {what} name cannot begin or end with a space "
                               "(--tasks strips the names it is given)")


@dataclass(frozen=True, slots=True)
class Shape:
    """A per-sample activation shape. `form` is 'tokens', 'features', 'sequence', 'pooled' or
    'loss'; `seq` is 1 for pooled and loss, `width` 0 for tokens and loss."""

    form: str
    seq: int
    width: int


def topo_steps(task: TaskSpec, where: str) -> list[str]:
    """Step names in a deterministic topological order (each step after the steps it reads,
    depth first in the order they are listed); FieldError on a cycle. Iterative: a chain of
    thousands of steps listed consumer first is as deep."""
    names = [s.name for s in task.steps]
    deps = {s.name: [i for i in s.inputs if i in names] for s in task.steps}
    order: list[str] = []
    state: dict[str, int] = {}  # 1: on the path being visited, 2: done
    for root in names:
        if root in state:
            continue
        path, pending = [root], [iter(deps[root])]
        state[root] = 1
        while path:
            d = next(pending[-1], None)
            if d is None:
                pending.pop()
                done = path.pop()
                state[done] = 2
                order.append(done)
            elif state.get(d) == 1:
                cyc = path[path.index(d):] + [d]
                raise FieldError(f"{where}.steps", f"cycle {' -> '.join(cyc)}")
            elif d not in state:
                state[d] = 1
                path.append(d)
                pending.append(iter(deps[d]))
    return order


def infer_shapes(model: ModelSpec, task: TaskSpec, where: str = "") -> dict[str, Shape]:
    """Per-sample output shape of every input and step of a task; FieldError on a mismatch."""
    shapes: dict[str, Shape] = {}
    for name, spec in task.inputs.items():
        shapes[name] = Shape("features" if spec.dim else "tokens", spec.seq_len, spec.dim)
    index = {s.name: i for i, s in enumerate(task.steps)}
    for name in topo_steps(task, where):
        i = index[name]
        step = task.steps[i]
        path = f"{where}.steps[{i}]"
        mod = model.modules[step.module]
        ins = [shapes[x] for x in step.inputs]
        forms = {s.form for s in ins}

        def need(cond: bool, problem: str, path: str = path) -> None:
            if not cond:
                raise FieldError(f"{path}.inputs", problem)

        k = mod.kind
        if k == "embedding":
            need(len(ins) == 1 and forms == {"tokens"}, "an embedding takes one token-id input")
            need(ins[0].seq <= mod.max_seq_len,
                 f"sequence {ins[0].seq} exceeds max_seq_len {mod.max_seq_len} of '{step.module}'")
            out = Shape("sequence", ins[0].seq, mod.hidden)
        elif k == "patch_embed":
            need(len(ins) == 1 and forms == {"features"}, "a patch_embed takes one feature input")
            need(ins[0].seq <= mod.max_seq_len,
                 f"sequence {ins[0].seq} exceeds max_seq_len {mod.max_seq_len} of '{step.module}'")
            need(ins[0].width == mod.in_dim,
                 f"feature width {ins[0].width} != in_dim {mod.in_dim} of '{step.module}'")
            out = Shape("sequence", ins[0].seq, mod.hidden)
        elif k in ("transformer_encoder", "transformer_decoder"):
            need(len(ins) >= 1 and forms == {"sequence"},
                 f"{article(k)} {k} takes sequence activations")
            for s in ins:
                need(s.width == mod.hidden,
                     f"input width {s.width} != hidden {mod.hidden} of '{step.module}'")
            out = Shape("sequence", sum(s.seq for s in ins), mod.hidden)
        elif k in ("adapter", "projection"):
            need(len(ins) == 1 and forms == {"sequence"},
                 f"{article(k)} {k} takes one sequence activation")
            need(ins[0].width == mod.in_dim,
                 f"input width {ins[0].width} != in_dim {mod.in_dim} of '{step.module}'")
            out = (Shape("sequence", ins[0].seq, mod.hidden) if k == "adapter"
                   else Shape("pooled", 1, mod.hidden))
        elif k == "contrastive_loss":
            need(len(ins) == 2 and forms == {"pooled"},
                 "a contrastive_loss takes two pooled embeddings")
            for s in ins:
                need(s.width == mod.hidden,
                     f"embedding width {s.width} != hidden {mod.hidden} of '{step.module}'")
            out = Shape("loss", 1, 0)
        else:
            need(len(ins) == 1 and forms == {"sequence"}, "an lm_loss takes one sequence input")
            need(ins[0].width == mod.hidden,
                 f"input width {ins[0].width} != hidden {mod.hidden} of '{step.module}'")
            need(ins[0].seq >= mod.target_len,
                 f"sequence {ins[0].seq} is shorter than target_len {mod.target_len}")
            out = Shape("loss", 1, 0)
        shapes[name] = out
    return shapes


def check_model(model: ModelSpec) -> None:
    """Validate references, uniqueness, DAG structure and shapes; raise FieldError."""
    if not model.tasks:
        raise FieldError("tasks", "a model needs at least one task")
    for name in model.modules:
        _check_label(name, field_path("modules", name), "module")
    seen_tasks: set[str] = set()
    for ti, task in enumerate(model.tasks):
        where = f"tasks[{ti}]"
        _check_name(task.name, f"{where}.name", "task")
        if task.name in seen_tasks:
            raise FieldError(f"{where}.name", f"duplicate task name {task.name!r}")
        seen_tasks.add(task.name)
        if not task.steps:
            raise FieldError(f"{where}.steps", "a task needs at least one step")
        names: set[str] = set()
        for si, step in enumerate(task.steps):
            sp = f"{where}.steps[{si}]"
            _check_name(step.name, f"{sp}.name", "step")
            if step.name in names:
                raise FieldError(f"{sp}.name", f"duplicate step name {step.name!r}")
            if step.name in task.inputs:
                raise FieldError(f"{sp}.name", f"step name {step.name!r} is also an input of "
                                               "the task (steps name what they output, and "
                                               "later steps read inputs and outputs by name)")
            names.add(step.name)
            if step.module not in model.modules:
                near = difflib.get_close_matches(step.module, list(model.modules), n=1)
                raise FieldError(f"{sp}.module", f"unknown module {step.module!r}" + (
                    f" (did you mean {near[0]!r}?)" if near else
                    f" (the model's modules: {', '.join(model.modules)})"))
            if not step.inputs:
                raise FieldError(f"{sp}.inputs", "a step needs at least one input")
            if model.modules[step.module].kind == "contrastive_loss" and task.batch_size < 2:
                raise FieldError(f"{where}.batch_size",
                                 f"{task.batch_size}, but step {step.name!r} is a contrastive "
                                 "loss, which scores each sample against the others of its "
                                 "batch: with none it is 0 and trains nothing (at least 2)")
        used: set[str] = set()
        for si, step in enumerate(task.steps):
            for ii, src in enumerate(step.inputs):
                if src not in names and src not in task.inputs:
                    raise FieldError(f"{where}.steps[{si}].inputs[{ii}]",
                                     f"unknown input or step {src!r}")
                if src == step.name:
                    raise FieldError(
                        f"{where}.steps[{si}].inputs[{ii}]", "a step cannot feed itself"
                    )
            if len(set(step.inputs)) != len(step.inputs):
                raise FieldError(f"{where}.steps[{si}].inputs", "an input is listed twice")
            used.update(step.inputs)
        for name in task.inputs:
            if name not in used:
                raise FieldError(field_path(f"{where}.inputs", name),
                                 "input is not used by any step")
        for step in task.steps:
            targets = targets_name(step.name)
            if model.modules[step.module].kind == "lm_loss" and targets in task.inputs:
                raise FieldError(field_path(f"{where}.inputs", targets),
                                 f"names the data item of the targets of lm_loss step "
                                 f"{step.name!r}: rename the input")
        infer_shapes(model, task, where)
        for name, spec in task.inputs.items():
            vocabs = sorted({model.modules[s.module].vocab_size for s in task.steps
                             if name in s.inputs})
            if not spec.dim and len(vocabs) > 1:
                raise FieldError(field_path(f"{where}.inputs", name),
                                 f"these token ids feed embeddings of vocab_size "
                                 f"{', '.join(map(str, vocabs))}: ids of one input index one "
                                 "vocabulary")
        # (a step fed a loss fails its own input check above: no kind takes a loss)
        for si, step in enumerate(task.steps):
            is_loss = model.modules[step.module].kind in LOSS_KINDS
            if not is_loss and step.name not in used:
                raise FieldError(f"{where}.steps[{si}]",
                                 f"output of {step.name!r} is not used (end each branch in a loss)")
    for set_name, members in model.task_sets.items():
        where = field_path("task_sets", set_name)
        if not members:
            raise FieldError(where, "a task set needs at least one task")
        for i, t in enumerate(members):
            if t not in seen_tasks:
                known = [task.name for task in model.tasks]
                near = difflib.get_close_matches(str(t), known, n=1)
                raise FieldError(f"{where}[{i}]", f"unknown task {t!r} " + (
                    f"(did you mean {near[0]!r}?)" if near else
                    f"(the model's tasks: {', '.join(known)})"))
        if len(set(members)) != len(members):
            raise FieldError(where, "a task is listed twice")
