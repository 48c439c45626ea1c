"""The report: benchmark, training and data results as tables, figures, HTML and Markdown."""
