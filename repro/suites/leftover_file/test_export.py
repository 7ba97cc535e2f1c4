def test_export_report(export_dir):
    # The polluter: writes into the shared directory and leaves the file there.
    (export_dir / "report.csv").write_text("name,value\nloss,0.1\n")
    assert (export_dir / "report.csv").exists()
