from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mme_runtime.models.user_code import UserCodeError, UserFunction, bind_functions, find_script, import_script
from mme_runtime.serving.contract import Contract


def test_context_is_detected_by_name_or_by_one_extra_parameter() -> None:
    def by_name(data, content_type, context): ...  # type: ignore[no-untyped-def]
    def by_count(data, content_type, ctx): ...  # type: ignore[no-untyped-def]
    def without(data, content_type): ...  # type: ignore[no-untyped-def]
    def optional(data, content_type, context=None): ...  # type: ignore[no-untyped-def]

    assert UserFunction.bind("input_fn", by_name).takes_context
    assert UserFunction.bind("input_fn", by_count).takes_context
    assert not UserFunction.bind("input_fn", without).takes_context
    assert UserFunction.bind("input_fn", optional).takes_context


def test_a_function_needing_too_many_arguments_is_refused_at_bind_time() -> None:
    def greedy(a, b, c, d): ...  # type: ignore[no-untyped-def]

    with pytest.raises(UserCodeError, match="input_fn takes 4 required arguments"):
        UserFunction.bind("input_fn", greedy)


def test_bound_function_passes_context_only_when_accepted() -> None:
    seen = []
    with_ctx = UserFunction.bind("output_fn", lambda p, a, context: seen.append(context))
    without_ctx = UserFunction.bind("output_fn", lambda p, a: seen.append("none"))
    context: Any = "ctx"
    Contract({"output_fn": with_ctx}).call("output_fn", context, 1, "x")
    Contract({"output_fn": without_ctx}).call("output_fn", context, 1, "x")
    assert seen == ["ctx", "none"]


def write(model_dir: Path, source: str) -> Path:
    (model_dir / "code").mkdir(parents=True)
    (model_dir / "code" / "inference.py").write_text(source)
    return model_dir


def test_two_models_with_the_same_script_name_never_share_functions(tmp_path: Path) -> None:
    a = write(tmp_path / "a", "def model_fn(model_dir):\n    return 'a'\n")
    b = write(tmp_path / "b", "def model_fn(model_dir):\n    return 'b'\n")
    module_a = import_script("a", find_script(a / "code", "inference.py"))  # type: ignore[arg-type]
    module_b = import_script("b", find_script(b / "code", "inference.py"))  # type: ignore[arg-type]
    assert module_a.__name__ != module_b.__name__
    assert bind_functions(module_a)["model_fn"].function("x") == "a"
    assert bind_functions(module_b)["model_fn"].function("x") == "b"


def test_missing_script_means_defaults(tmp_path: Path) -> None:
    assert find_script(tmp_path, "inference.py") is None
    assert find_script(None, "inference.py") is None
    assert bind_functions(None) == {}


def test_import_failure_names_the_script_and_cause(tmp_path: Path) -> None:
    model = write(tmp_path / "m", "import not_a_real_package\n")
    expected = r"^import error in code/inference.py: No module named 'not_a_real_package' \(add the package that"
    with pytest.raises(UserCodeError, match=expected):
        import_script("m", find_script(model / "code", "inference.py"))  # type: ignore[arg-type]


def test_an_exception_at_import_names_the_script_and_its_type(tmp_path: Path) -> None:
    model = write(tmp_path / "m", "raise ValueError('no config')\n")
    with pytest.raises(UserCodeError, match=r"^importing code/inference.py raised ValueError: no config$"):
        import_script("m", find_script(model / "code", "inference.py"))  # type: ignore[arg-type]


def test_transform_fn_cannot_be_combined_with_input_fn(tmp_path: Path) -> None:
    model = write(
        tmp_path / "m",
        "def transform_fn(m, b, c, a):\n    pass\n\ndef input_fn(b, c):\n    pass\n",
    )
    module = import_script("m", find_script(model / "code", "inference.py"))  # type: ignore[arg-type]
    with pytest.raises(UserCodeError, match="transform_fn cannot be combined"):
        bind_functions(module)
