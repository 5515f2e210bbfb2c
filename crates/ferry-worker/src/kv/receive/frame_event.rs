//! A frame of the TCP data path or a device pipe ([`crate::kv::frame`]) as what it means to the
//! receiving state machine: an [`Event`] ([`FrameEvent::event`]). The frame format itself is
//! shared with the sending side and knows nothing of the receiver.

use super::inbound::Event;
use crate::kv::frame::{FrameHeader, Kind};
use ferry_proto::v1::{kv_chunk, KvChunk};
use prost::Message;

/// A frame's meaning to the receiving state machine.
pub trait FrameEvent {
    /// What this frame means; `body` is a control frame's body (a data or buffer frame's body is
    /// read later, where the state machine says).
    fn event(&self, body: &[u8]) -> Event;
}

impl FrameEvent for FrameHeader {
    fn event(&self, body: &[u8]) -> Event {
        let chunk = || KvChunk::decode(body).map(|c| (c.transfer_id, c.part));
        match self.kind {
            Kind::Data | Kind::Buffer => Event::Chunk(self.as_chunk()),
            Kind::Begin => match chunk() {
                Ok((id, Some(kv_chunk::Part::Begin(begin)))) => Event::Begin { id, begin },
                _ => Event::Malformed("undecodable begin frame".into()),
            },
            Kind::End => match chunk() {
                Ok((_, Some(kv_chunk::Part::End(end)))) => Event::End(end),
                _ => Event::Malformed("undecodable end frame".into()),
            },
            Kind::Abort => Event::Abort,
            Kind::Close => Event::Close,
            Kind::Reply => Event::Malformed("a reply frame sent to the receiver".into()),
            Kind::Hello => Event::Malformed("a hello frame after the connection's first".into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::chunks::Chunk;
    use crate::kv::frame::{message, HEADER_BYTES};

    #[test]
    fn frames_become_events() {
        let begin = KvChunk { transfer_id: 7, part: Some(kv_chunk::Part::Begin(Default::default())) };
        let f = message(Kind::Begin, &begin);
        let h = FrameHeader::decode(f[..HEADER_BYTES].try_into().unwrap()).unwrap();
        assert!(matches!(h.event(&f[HEADER_BYTES..]), Event::Begin { id: 7, .. }));
        assert!(matches!(h.event(b"\xff\xff"), Event::Malformed(m) if m.contains("begin")));
        let end = KvChunk { transfer_id: 7, part: Some(kv_chunk::Part::End(Default::default())) };
        assert!(matches!(FrameHeader::control(Kind::End, 0).event(&end.encode_to_vec()), Event::End(_)));
        assert!(matches!(FrameHeader::control(Kind::End, 0).event(&begin.encode_to_vec()), Event::Malformed(_)), "begin in an end frame");
        let data = FrameHeader { kind: Kind::Buffer, len: 8, offset: 4, crc: 9 };
        assert!(matches!(data.event(&[]), Event::Chunk(Chunk { offset: 4, len: 8, crc: 9, buffer: true })));
        assert!(matches!(FrameHeader::control(Kind::Reply, 0).event(&[]), Event::Malformed(_)));
    }
}
