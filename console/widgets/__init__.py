"""The console's widgets: small, one job each, fed by their screens (attributes down, messages up)."""

from console.widgets.alert_list import AlertList
from console.widgets.cell_panel import CellPanel
from console.widgets.fleet_table import FleetTable
from console.widgets.heatmap import HeatmapView

__all__ = ["AlertList", "CellPanel", "FleetTable", "HeatmapView"]
