"""Workbook infrastructure: MLflow tracking, the papermill runner, the MLflow UI and JupyterLab servers."""
