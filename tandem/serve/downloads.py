"""The signed downloads of checkpoints (`tandem.serve.archives`): the archive URL of the SDK before
0.38 (`get_checkpoint_archive_url`), the per-file URLs of 0.38's external weights
(`get_external_weights_urls`), and the download route they point to, which needs no API key: its
URL's signature (`Signer`) stands for it, for an hour, and ends with the service.
"""

import asyncio
import datetime
import shutil
import tempfile
import time
from pathlib import Path
from urllib.parse import quote, urlencode

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, Response
from starlette.background import BackgroundTask
from tinker import types

from tandem.model.config import model_dir
from tandem.serve import archives
from tandem.serve.archives import AGE, Signer, encrypt, members, sampler_dir, write_archive
from tandem.serve.catalog import find, utc
from tandem.serve.futures import NotFound
from tandem.serve.service import Service
from tandem.serve.snapshots import Named

URL_TTL_S = 3600  # how long a download URL works
DOWNLOAD = "/api/v1/download/"


def download_routes(api: APIRouter, service: Service) -> None:
    signer = Signer()

    def url(request: Request, run_id: str, kind: str, name: str, file: str) -> tuple[str, datetime.datetime]:
        expires = int(time.time()) + URL_TTL_S
        target = f"{run_id}/{kind}/{name}"
        query = urlencode({"expires": expires, "signature": signer.sign(target, expires)})
        base = str(request.base_url).rstrip("/")
        return f"{base}{DOWNLOAD}{quote(run_id)}/{kind}/{name}/{file}?{query}", utc(expires)

    @api.get("/training_runs/{run_id}/checkpoints/{kind}/{name}/archive")
    async def archive_url(run_id: str, kind: str, name: str, request: Request):
        """The JSON form of the SDK's archive contract (a 302 redirect is its other)."""
        find(service, run_id, kind, name)
        link, expires = url(request, run_id, kind, name, "archive.tar")
        return {"url": link, "expires": expires.isoformat()}

    @api.get("/training_runs/{run_id}/checkpoints/{kind}/{name}/external_weights_urls")
    async def external_urls(run_id: str, kind: str, name: str, request: Request):
        path, found = find(service, run_id, kind, name)
        with tempfile.TemporaryDirectory(prefix="tandem-download-") as tmp:
            files = members(await readable(service, path, found, Path(tmp)), service.base_model)
        suffix = AGE if keys_of(service, found) else ""
        urls = {f + suffix: url(request, run_id, kind, name, f + suffix) for f in files}
        expires = min((e for _, e in urls.values()), default=utc(time.time() + URL_TTL_S))
        signed = {f: u for f, (u, _) in urls.items()}
        return types.ExternalWeightsUrlsResponse(urls=signed, expires=expires).model_dump(mode="json")

    @api.get(DOWNLOAD.removeprefix("/api/v1") + "{run_id}/{kind}/{name}/{file:path}")
    async def download(run_id: str, kind: str, name: str, file: str, expires: int = 0, signature: str = ""):
        """A file of a checkpoint, or its archive built for this download in a temporary
        directory, which goes once the answer is sent."""
        signer.check(f"{run_id}/{kind}/{name}", expires, signature)
        path, found = find(service, run_id, kind, name)
        tmp = Path(tempfile.mkdtemp(prefix="tandem-download-"))
        try:
            folder = await readable(service, path, found, tmp)
            done = BackgroundTask(shutil.rmtree, tmp, ignore_errors=True)
            if keys := keys_of(service, found):  # encrypted: each file alone, as it is sent
                source = members(folder, service.base_model).get(file.removesuffix(AGE))
                if source is None or not file.endswith(AGE):
                    raise NotFound(f"{path!r} has no file {file!r} (its files are encrypted: <file>.age).")
                sealed = await asyncio.to_thread(encrypt, source, keys, tmp / "sealed")
                return FileResponse(sealed, filename=Path(file).name, background=done)
            if file in archives.KINDS:
                merged = file == "merged.tar"
                await asyncio.to_thread(write_archive, folder, service.base_model, merged, tmp / file)
                tar = "application/x-tar"
                return FileResponse(tmp / file, media_type=tar, filename=file, background=done)
            source = members(folder, service.base_model).get(file)
            if source is None:
                raise NotFound(f"{path!r} has no file {file!r}.")
            if isinstance(source, bytes):
                return Response(source, media_type="application/octet-stream", background=done)
            return FileResponse(source, filename=Path(file).name, background=done)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def keys_of(service: Service, found: Path | Named) -> list[str]:
    """The age recipients a checkpoint's files are sent encrypted to ([]: none)."""
    return [] if isinstance(found, Named) else service.checkpoints.meta(found).get("age_recipients") or []


async def readable(service: Service, path: str, found: Path | Named, tmp: Path) -> Path:
    """A checkpoint's directory to read: its own, or for a sampler checkpoint one laid out in `tmp`
    (`archives.sampler_dir`)."""
    if isinstance(found, Path):
        return found
    weights = {n: t.cpu() for n, t in service.sampling.snapshots.get(path).items()}
    base = model_dir(service.cfg.model.path)
    return await asyncio.to_thread(sampler_dir, weights, base, service.cfg.train.lora, tmp / "view")
