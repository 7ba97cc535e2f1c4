def test_export_dir_starts_empty(export_dir):
    # The victim: assumes nobody exported before it in this process.
    assert sorted(p.name for p in export_dir.iterdir()) == []
