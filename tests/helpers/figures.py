"""Saved matplotlib figures, drawn again for checks of their layout."""

from __future__ import annotations


def record_saved(monkeypatch) -> list:
    """The figures saved from now on (matplotlib's ``Figure.savefig``, wrapped)."""
    from matplotlib.figure import Figure

    figures = []
    original = Figure.savefig

    def savefig(self, *args, **kwargs):
        figures.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return figures


def legends_beside_their_axes(figures) -> int:
    """Assert that no legend overlaps its axes and each lies inside its figure (not cut
    off by the saved image); return how many legends there are."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    legends = 0
    for fig in figures:
        canvas = FigureCanvasAgg(fig)  # saved figures are closed: draw them again
        canvas.draw()
        renderer = canvas.get_renderer()
        figure_box = fig.bbox
        for ax in fig.axes:
            legend = ax.get_legend()
            if legend is None:
                continue
            legends += 1
            box = legend.get_window_extent(renderer)
            area = ax.get_window_extent(renderer)
            assert not box.overlaps(area), (ax.get_title(), box, area)
            inside = figure_box.contains(box.x0, box.y0) and figure_box.contains(box.x1, box.y1)
            assert inside, (ax.get_title(), box, figure_box)
    return legends
