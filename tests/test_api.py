from __future__ import annotations

import paratrain


def test_public_api_is_explicit():
    assert "DataParallel" in paratrain.__all__
    for name in paratrain.__all__:
        assert hasattr(paratrain, name), name
    public = {n for n in dir(paratrain) if not n.startswith("_")}
    modules = {n for n in public if type(getattr(paratrain, n)).__name__ == "module"}
    assert public - modules == set(paratrain.__all__) - {"__version__"}
