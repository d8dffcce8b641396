"""The test project's URLs: the admin, and the outbox status page outside it."""

from __future__ import annotations

from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("admin/", admin.site.urls),
    path("ops/outbox/", include("outbound.contrib.django.urls")),
]
