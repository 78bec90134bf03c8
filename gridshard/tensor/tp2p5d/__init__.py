"""``2.5d``: d depth layers of a q×q grid, each running the 2D layout (Tesseract)."""
