"""Workbook infrastructure: MLflow tracking, the papermill runner, the MLflow UI and JupyterLab servers, and the
start helper every notebook calls instead of repeating its preamble."""
