"""`ebpo.core.fields.doc`: a documented dataclass field carries its help text, its default or its default factory."""
import dataclasses


from ebpo.core.fields import doc


def test_doc_fields_carry_help_default_and_factory():
    @dataclasses.dataclass
    class C:
        a: int = doc("the a", 3)
        b: list = doc("the b", default_factory=lambda: [1])
        c: int = doc("the c", None)

    f = {x.name: x for x in dataclasses.fields(C)}
    assert f["a"].metadata["help"] == "the a" and f["a"].default == 3
    assert f["b"].metadata["help"] == "the b" and f["b"].default is dataclasses.MISSING and C().b == [1]
    assert f["c"].default is None and f["c"].default_factory is dataclasses.MISSING
    assert C() == C(3, [1], None) and C().b is not C().b
    required = doc("required")
    assert required.default is dataclasses.MISSING and required.default_factory is dataclasses.MISSING
    assert dict(required.metadata) == {"help": "required"}
