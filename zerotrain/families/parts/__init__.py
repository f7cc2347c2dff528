"""Parts that several families share and that are no family themselves (no FAMILY): family modules import
them, and they import no family module (tests/unit/test_layout.py holds both)."""
